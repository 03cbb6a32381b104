"""Multi-head latent attention (MLA, DeepSeek-V2 section 2.1), as HuggingFace's ``DeepseekV3Attention``
computes it, with its heads split over tensor-parallel ranks.

On the layer's input x [s, b, h] (gathered once under sequence parallelism), n heads, D_nope =
``--qk-head-dim``, D_r = ``--qk-pos-emb-head-dim``, D_v = ``--v-head-dim``::

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))  or  q_proj(x)       [s, b, n, D_nope + D_r]
    latent, k_r  = split(kv_a_proj_with_mqa(x), [R_kv, D_r])                 k_r: one head, shared
    k_nope, v    = split(kv_b_proj(kv_a_layernorm(latent)), [D_nope, D_v])   [s, b, n, .] each
    query, key   = [rope(q_r), q_nope], [rope(k_r) for every head, k_nope]
    out          = o_proj(softmax(query key^T / sqrt(D_nope + D_r)) v)       causal

Under ``--rope-type yarn`` the rope is YaRN's and the softmax scale is multiplied by mscale^2 (:mod:`.yarn`),
applied to the queries so that every attention path (cp, the latent cache) keeps torch's default scale.

Queries and keys are laid out RoPE part first (the dot product does not depend on the order of features, and
the shared attention core rotates a head's first ``rotary_dim`` features). RoPE pairs features the "rotate
half" way; DeepSeek's checkpoints store the rotated rows of ``q_b_proj`` / ``q_proj`` and
``kv_a_proj_with_mqa`` in interleaved pairs (HF ``rope_interleave``), which the HF adapter reorders
(:mod:`.hf`).

Parameters (full, tp = 1, layouts; nn.Linear orientation [out, in], no biases):

================================  =========================  ==========================================
``q_a_proj.weight``               [R_q, h]                   replicated (with ``--q-lora-rank``)
``q_a_layernorm.weight``          [R_q]                      replicated
``q_b_proj.weight``               [n (D_nope + D_r), R_q]    split dim 0: whole heads, head by head,
                                                             inside a head the D_nope part then D_r (HF)
``q_proj.weight``                 [n (D_nope + D_r), h]      instead of the three above (no q rank)
``kv_a_proj_with_mqa.weight``     [R_kv + D_r, h]            replicated: the latent, then the shared k_r
``kv_a_layernorm.weight``         [R_kv]                     replicated
``kv_b_proj.weight``              [n (D_nope + D_v), R_kv]   split dim 0, head by head: k_nope then v
``dense.weight`` (HF o_proj)      [h, n D_v]                 split dim 1 (row-parallel)
================================  =========================  ==========================================

Generation (a :class:`~megazero.spec.kv_cache.KVCache`) caches, per layer and token, the normed latent and the
rotated shared key part (R_kv + D_r numbers, DeepSeek-V2's point) instead of every head's keys and values
(n (D_nope + D_r + D_v)), and expands the cached latents through ``kv_b_proj`` at each step.

Tensor parallelism: tp rank r holds heads ``r n/tp ..`` of the split projections; every rank computes the
replicated down-projections and their norms on the whole sequence, but only its heads use them, so each
rank's gradient of those weights is partial: they are marked ``sequence_parallel_grad`` and summed over tp
after backward (as :class:`~megazero.models.gpt.transformer.ReplicatedLinear`'s), with or without sequence
parallelism.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.models.deepseek_v3.yarn import softmax_scale_factor
from megazero.models.gpt.transformer import LayerContext, ReplicatedLinear, RMSNorm, core_attention
from megazero.parallel.fp8 import linear
from megazero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    set_tp_attributes,
)
from megazero.spec.kv_cache import LayerKVCache


def latent_norm(ctx: LayerContext, features: int) -> RMSNorm:
    """The RMSNorm of a latent (replicated over tp; its gradient partial under tp: summed after backward)."""
    norm = RMSNorm(features, ctx.cfg.layernorm_epsilon, dtype=ctx.dtype, device=ctx.device)
    set_tp_attributes(norm.weight, False, sequence_parallel_grad=ctx.tp_size > 1)
    norm.is_norm = True
    return norm


class MultiLatentAttention(nn.Module):
    """Causal multi-head latent attention on [s(/tp), b, h] (see the module docstring for the math, the
    parameters and which tp rank holds what)."""

    def __init__(self, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        cfg, tp = ctx.cfg, ctx.tp_size
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.heads_local = heads // tp
        self.nope, self.rope, self.value = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        kw, partial = ctx.linear_kw(), tp > 1
        query_width = heads * (self.nope + self.rope)
        if cfg.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, partial, False, ctx.dtype, ctx.device)
            self.q_a_layernorm = latent_norm(ctx, cfg.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, query_width, ctx.tp_group, bias=False, **kw)
        else:
            self.q_proj = ColumnParallelLinear(h, query_width, ctx.tp_group, bias=False, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_rank + self.rope, partial, False, ctx.dtype,
                                                   ctx.device)
        self.kv_a_layernorm = latent_norm(ctx, self.kv_rank)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.value), ctx.tp_group,
                                              bias=False, **kw)
        self.dense = RowParallelLinear(heads * self.value, h, ctx.tp_group, bias=False, **kw)
        self.softmax_factor = softmax_scale_factor(cfg)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        ctx = self.ctx
        x = gather_from_sequence_parallel_region(x, ctx.tp_group) if ctx.sp else copy_to_tp_region(x, ctx.tp_group)
        s, b = x.shape[:2]
        q = self._queries(x).view(s, b, self.heads_local, self.nope + self.rope)
        if self.softmax_factor != 1.0:                 # YaRN's softmax scale, folded into the queries
            q = q * self.softmax_factor
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = linear(x, self.kv_a_proj_with_mqa.weight, None, None).split([self.kv_rank, self.rope], -1)
        if cache is not None:
            return self.dense(self._cached_attention(q_rope, q_nope, latent, k_rope, cache))
        latent = self.kv_a_layernorm(latent)
        kv = linear(latent, self.kv_b_proj.weight, None, self.kv_b_proj.fp8)
        k_nope, v = kv.view(s, b, self.heads_local, self.nope + self.value).split([self.nope, self.value], dim=-1)
        k_rope = k_rope.unsqueeze(2).expand(s, b, self.heads_local, self.rope)
        query, key = torch.cat((q_rope, q_nope), dim=-1), torch.cat((k_rope, k_nope), dim=-1)
        return self.dense(core_attention(ctx, query, key, v, None, self.training))

    def _cached_attention(self, q_rope, q_nope, latent, k_rope, cache: LayerKVCache) -> torch.Tensor:
        """Inference with the compressed cache: the layer caches each token's normed latent [R_kv] and rotated
        shared key part [D_r] (as "keys" [b, 1, length, R_kv] and "values" [b, 1, length, D_r]), not each
        head's keys and values, and expands every cached latent through ``kv_b_proj`` for the new queries.
        -> [s, b, heads * D_v]."""
        s, b = q_rope.shape[:2]
        offset, rotary = cache.owner.length, self.ctx.rotary
        q_rope, k_rope = rotary(q_rope, offset), rotary(k_rope.unsqueeze(2), offset)       # [s, b, ., D_r]
        latents, shared = cache.append(self.kv_a_layernorm(latent).transpose(0, 1).unsqueeze(1),
                                       k_rope.permute(1, 2, 0, 3))                        # [b, 1, L, .]
        length = latents.shape[2]
        kv = linear(latents[:, 0], self.kv_b_proj.weight, None, None).view(b, length, self.heads_local, -1)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.value], dim=-1)              # [b, heads, L, .]
        key = torch.cat((shared.expand(b, self.heads_local, length, self.rope), k_nope), dim=-1)
        query = torch.cat((q_rope, q_nope), dim=-1).permute(1, 2, 0, 3)                    # [b, heads, s, .]
        mask = torch.ones(s, length, dtype=torch.bool, device=query.device).tril(offset)
        out = F.scaled_dot_product_attention(query, key, v, attn_mask=mask)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' queries [s, b, heads_local (D_nope + D_r)] from the gathered input."""
        if hasattr(self, "q_proj"):
            return linear(x, self.q_proj.weight, None, self.q_proj.fp8)
        latent = self.q_a_layernorm(linear(x, self.q_a_proj.weight, None, None))
        return linear(latent, self.q_b_proj.weight, None, self.q_b_proj.fp8)
