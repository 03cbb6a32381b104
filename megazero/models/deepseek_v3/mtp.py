"""Multi-token prediction (DeepSeek-V3 section 2.2; ``--mtp-num-layers D``, ``--mtp-loss-scaling-factor f``).

D sequential modules after the decoder, on the last pipeline stage, sharing the model's word embedding and
output layer. Module k (k = 1 .. D) at position t combines the previous hidden state (the decoder's output
before its final norm for k = 1, module k-1's output after) with the embedding of token t+k, and predicts
token t+k+1::

    h_k[t]  = Layer_k(eh_proj([enorm(Emb(token[t+k])); hnorm(h_{k-1}[t])]))     eh_proj: [h, 2h]
    CE_k[t] = cross-entropy(Head(final_norm_k(h_k[t])), token[t+k+1])            t + k + 1 < s

``labels[t]`` is token t+1, so module k reads its input tokens and targets from the labels shifted by k-1 and
k (the last stage needs no input ids); the last k positions have no target. The loss (the spec's) is::

    loss = main + f / D * sum_k masked_mean(CE_k, loss_mask shifted by k)

Parameters (``k-1`` = 0 .. D-1; replicated over tp, their gradients partial under sequence parallelism)::

    mtp.<k-1>.enorm.weight, mtp.<k-1>.hnorm.weight    [h]
    mtp.<k-1>.eh_proj.weight                          [h, 2h]   input features: the embedding's, then h's
    mtp.<k-1>.layer.*                                 a decoder layer (global index num_layers + k - 1)
    mtp.<k-1>.final_norm.weight                       [h]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.models.gpt.transformer import LayerContext, ReplicatedLinear


class MTPModule(nn.Module):
    """One multi-token prediction module (see the module docstring); ``layer`` is its decoder layer."""

    def __init__(self, ctx: LayerContext, layer: nn.Module):
        super().__init__()
        h = ctx.cfg.hidden_size
        self.enorm, self.hnorm = ctx.norm(), ctx.norm()
        self.eh_proj = ReplicatedLinear(2 * h, h, ctx.sp, False, ctx.dtype, ctx.device)
        self.layer = layer
        self.final_norm = ctx.norm()

    def forward(self, previous: torch.Tensor, token_ids: torch.Tensor, embed) -> torch.Tensor:
        """``previous`` [s(/tp), b, h] and the ids [b, s] of the tokens to embed (``embed``: the model's word
        embedding, called here so that ZeRO-3 gathers it for this module's forward) -> this module's hidden
        state [s(/tp), b, h] (its ``final_norm`` is applied by the caller, before the shared head)."""
        both = torch.cat((self.enorm(embed(token_ids)), self.hnorm(previous)), dim=-1)
        return self.layer(F.linear(both, self.eh_proj.weight))


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` [b, s] moved k positions left along the sequence (wrapping round; the caller masks the last k)."""
    return torch.roll(t, -k, dims=1)


def shifted_mask(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """The loss mask of module k's targets: position t counts where t+k is counted and t+k < s."""
    out = torch.zeros_like(loss_mask)
    out[:, :loss_mask.shape[1] - k] = loss_mask[:, k:]
    return out
