"""The DeepSeek-V3 decoder: GPT's decoder (:class:`megazero.models.gpt.GPT`: embedding, pre-norm layers,
final norm, untied head, pipeline chunks, ZeRO-3 units, layout-independent init) whose layers attend with
multi-head latent attention (:mod:`.attention`), and with ``--mtp-num-layers`` the multi-token prediction
modules on the last stage (:mod:`.mtp`).

Parameter names are GPT's (``embedding.word_embeddings.weight``, ``layers.<i>.input_layernorm.weight``,
``layers.<i>.mlp...``, ``final_norm.weight``, ``output_layer.weight``) with MLA's projections under
``layers.<i>.attention.`` (:class:`~megazero.models.deepseek_v3.attention.MultiLatentAttention` lists them
and their tensor-parallel splits) and the MTP modules under ``mtp.<k>.``.

With MTP the last stage uses the word embedding too: when it is not also the first stage it holds a copy
(same init, ``shared_embedding``, ``tied_copy``: not saved, not counted), whose gradient the ZeRO engine sums
with the first stage's over the embedding group every step, as for GPT's tied embeddings, so the two stay
equal. With labels the last stage then returns the per-token losses [b, s, 1 + D]: the main one, then each
module's scaled by ``f / D`` (the spec's loss masks and averages them: :func:`mtp_loss`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megazero.models.deepseek_v3.attention import MultiLatentAttention
from megazero.models.deepseek_v3.mtp import MTPModule, shifted, shifted_mask
from megazero.models.deepseek_v3.yarn import yarn_attention_factor, yarn_inverse_frequencies
from megazero.models.gpt import GPT, masked_mean
from megazero.models.gpt.rotary import RotaryEmbedding
from megazero.models.gpt.transformer import Embedding, LayerContext, TransformerLayer
from megazero.parallel.zero.units import UnitUse, Zero3Plan, trainable


class DeepSeekV3Layer(TransformerLayer):
    """One pre-norm block (GPT's: norm, attention, norm, MLP or MoE layer) with latent attention."""

    def build_attention(self, ctx: LayerContext) -> nn.Module:
        return MultiLatentAttention(ctx)


class DeepSeekV3(GPT):
    """The DeepSeek-V3 model, or the chunk of it one pipeline stage owns (GPT's constructor and forward;
    see :class:`megazero.models.gpt.GPT`); the last stage's forward with labels adds the MTP losses."""

    def build_layer(self, ctx: LayerContext, layer_id: int) -> nn.Module:
        return DeepSeekV3Layer(ctx, layer_id)

    def add_modules(self, ctx: LayerContext) -> None:
        """The YaRN-scaled RoPE table under ``--rope-type yarn`` (every stage), the MTP modules on the last
        stage, and there the word embedding they read (a tied copy when this chunk is not also the first
        stage)."""
        if ctx.cfg.rope_type == "yarn":
            ctx.rotary = RotaryEmbedding(ctx.cfg, yarn_inverse_frequencies, yarn_attention_factor(ctx.cfg))
        depth = ctx.cfg.mtp_depth
        if depth and self.pre_process:      # the first stage's embedding: its gradient summed with the copy's
            self.embedding.word_embeddings.weight.shared_embedding = True
        if not (self.post_process and depth):
            return
        if not hasattr(self, "embedding"):
            self.embedding = Embedding(ctx, self.padded_vocab_size, with_positions=False)
            word = self.embedding.word_embeddings.weight
            word.vocab_padded = word.embedding_or_output = word.tied_copy = True
        self.embedding.word_embeddings.weight.shared_embedding = True
        layers = ctx.cfg.num_layers
        self.mtp = nn.ModuleDict({str(k): MTPModule(ctx, DeepSeekV3Layer(ctx, layers + k)) for k in range(depth)})
        self.mtp_record: list[torch.Tensor] = []     # each training micro-batch's module losses, for the log line
        for p in self.mtp.parameters():
            p.layer_matrix = p.dim() == 2

    def output(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """GPT's head; with labels and MTP, the per-token losses [b, s, 1 + D] (see the module docstring)."""
        main = super().output(h, labels)
        if labels is None or not hasattr(self, "mtp"):
            return main
        scale = self.cfg.mtp_loss_scaling_factor / len(self.mtp)
        losses = [main]
        for k, module in enumerate(self.mtp.values(), start=1):
            h = module(h, shifted(labels, k - 1), self.embedding)
            losses.append(scale * self.head_loss(module.final_norm(h), shifted(labels, k)))
        out = torch.stack(losses, dim=-1)
        out.mtp_record, out.mtp_scale = self.mtp_record, scale      # where the spec's loss reports each CE_k
        return out

    def zero3_plan(self) -> Zero3Plan:
        """GPT's units, and each MTP module a unit of its own whose use also gathers the word embedding
        (the first stage's ``embedding`` unit, or this stage's copy as ``mtp_embedding``); the module's final
        norm is a unit apart, used before the head and released when the chunk's forward ends (as GPT's
        ``head``)."""
        plan = super().zero3_plan()
        if not hasattr(self, "mtp"):
            return plan
        word = self.embedding.word_embeddings.weight
        embedding = next((name for name, members in plan.units.items() if any(p is word for _, p in members)), None)
        if embedding is None:
            embedding = "mtp_embedding"
            plan.units[embedding] = [("embedding.word_embeddings.weight", word)]
        for key, module in self.mtp.items():
            norm = {id(p) for p in module.final_norm.parameters()}
            plan.units[f"mtp.{key}"] = [(n, p) for n, p in trainable(module, f"mtp.{key}.") if id(p) not in norm]
            plan.units[f"mtp.{key}.final_norm"] = trainable(module.final_norm, f"mtp.{key}.final_norm.")
            plan.uses.append(UnitUse(f"mtp.{key}", module, module, [f"mtp.{key}", embedding]))
            plan.uses.append(UnitUse(f"mtp.{key}.final_norm", module.final_norm, self, [f"mtp.{key}.final_norm"]))
        return plan


def mtp_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The spec's loss: the masked mean of the per-token loss [b, s]; with MTP ([b, s, 1 + D], each module's
    already scaled by f / D) plus each module's masked mean over its targets (the mask shifted by k)."""
    if per_token.dim() == 2:
        return masked_mean(per_token, loss_mask)
    total = masked_mean(per_token[..., 0], loss_mask)
    for k in range(1, per_token.shape[-1]):
        term = masked_mean(per_token[..., k], shifted_mask(loss_mask, k))
        if per_token.requires_grad and hasattr(per_token, "mtp_record"):      # training: the log line's CE_k
            per_token.mtp_record.append(term.detach() / per_token.mtp_scale)
        total = total + term
    return total


def mtp_metrics(chunks, job, tp_rank: int, steps: int, device) -> dict:
    """``mtp_loss``: the MTP modules' cross-entropy (unscaled, averaged over modules, micro-batches, data-parallel
    ranks and the last ``steps`` steps), for the log line. A collective over the world (every rank calls it)."""
    if not job.model.mtp_depth:
        return {}
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for chunk in chunks:
        record = getattr(chunk, "mtp_record", None)
        if record and tp_rank == 0:
            total[0] += float(torch.stack(record).sum())
            total[1] += len(record)
        if record is not None:
            record.clear()
    dist.all_reduce(total)
    return {"mtp_loss": (total[0] / total[1]).item()} if total[1] else {}
