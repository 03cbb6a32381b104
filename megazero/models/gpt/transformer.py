"""The decoder's layers, built from the tensor-parallel layers of :mod:`megazero.parallel.tensor`.

Which layer a config gets (Megatron's GPTModel flags; the defaults are GPT-2):

======================  =================================  =====================================
flag                    default (GPT-2)                    Llama family
======================  =================================  =====================================
normalization           ``nn.LayerNorm`` (weight, bias)    :class:`RMSNorm` (weight); either
                                                           zero-centred with ``--apply-layernorm-1p``
attention               :class:`SelfAttention`, fused      :class:`GroupedQueryAttention`
                        per-head QKV                       (``--group-query-attention``)
position embedding      learned table (:class:`Embedding`) RoPE inside attention (``rotary.py``)
MLP                     GELU                               SwiGLU (``--swiglu``, fused gate/up)
biases                  every linear layer                 none (``--disable-bias-linear``; QKV
                                                           only with ``--add-qkv-bias``)
======================  =================================  =====================================

Activations are [s, b, h] (sequence first); under sequence parallelism [s/tp, b, h] between the
tensor-parallel regions. The full (tp=1) layout of every fused weight is documented at its layer:
it does not depend on tp, tp rank r holds the r-th contiguous chunk along the split dim, and the
HF converters (``megazero/checkpoint/hf_*.py``) rely on it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import FLAG
from megazero.kernels import apex_norm, rms_norm, swiglu, use_apex_norms
from megazero.models.gpt.config import GPTConfig
from megazero.models.gpt.moe import MoELayer
from megazero.models.gpt.rotary import RotaryEmbedding
from megazero.parallel.context import context_parallel_attention, grouped_key_values
from megazero.parallel.context_layout import rank_positions
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.fp8 import linear
from megazero.parallel.groups import ModelParallelGroups
from megazero.parallel.raw_comm import group_rank, group_size
from megazero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRNG,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    new_parameter,
    set_tp_attributes,
)
from megazero.parallel.wgrad_fusion import gate_up
from megazero.spec.kv_cache import LayerKVCache
from megazero.spec.recompute import checkpointed, free_until_backward, selective_modules


def qkv_blocks_to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder a full fused-QKV weight [3h, ...] (or bias [3h]) from blocks [Q_all; K_all; V_all]
    (HF GPT-2 ``c_attn`` after transposing its [h, 3h] Conv1D weight) to our per-head
    [q_0; k_0; v_0; q_1; ...] rows (see :class:`SelfAttention`)."""
    d = w.shape[0] // (3 * num_heads)
    return w.reshape(3, num_heads, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def qkv_interleaved_to_blocks(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`qkv_blocks_to_interleaved`: our per-head rows -> [Q_all; K_all; V_all]."""
    d = w.shape[0] // (3 * num_heads)
    return w.reshape(num_heads, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def kv_blocks_to_interleaved(k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF ``k_proj`` and ``v_proj`` (weights [G*d, h] or biases [G*d]) -> our ``key_value`` rows,
    group by group [k_0; v_0; k_1; v_1; ...] (see :class:`GroupedQueryAttention`)."""
    d = k.shape[0] // groups
    return torch.stack([k.reshape(groups, d, *k.shape[1:]), v.reshape(groups, d, *v.shape[1:])], 1).reshape(
        2 * k.shape[0], *k.shape[1:])


def kv_interleaved_to_blocks(kv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`kv_blocks_to_interleaved`: our ``key_value`` rows -> (k_proj, v_proj)."""
    d = kv.shape[0] // (2 * groups)
    pairs = kv.reshape(groups, 2, d, *kv.shape[1:])
    return pairs[:, 0].reshape(groups * d, *kv.shape[1:]), pairs[:, 1].reshape(groups * d, *kv.shape[1:])


def gate_up_to_interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj`` and ``up_proj`` ([f, h] each) -> our SwiGLU ``dense_h_to_4h`` [2f, h] (see :class:`MLP`)."""
    return torch.stack([gate, up], 1).reshape(2 * gate.shape[0], *gate.shape[1:])


def interleaved_to_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`gate_up_to_interleaved`: our [2f, h] -> (gate_proj, up_proj)."""
    pairs = w.reshape(w.shape[0] // 2, 2, *w.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (Llama's norm: no mean removal, no bias).
    ``zero_centred`` (``--apply-layernorm-1p``): ``weight`` holds scale - 1, starts at 0, and the norm
    scales by 1 + weight."""

    def __init__(self, hidden_size: int, eps: float, dtype=None, device=None, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        init = torch.zeros if zero_centred else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred)


class ZeroCentredLayerNorm(nn.LayerNorm):
    """LayerNorm whose ``weight`` holds scale - 1 (Megatron's ``--apply-layernorm-1p``): it starts at 0 and
    the norm computes ``(x - mean) / std * (1 + weight) + bias``, so weight decay would pull the scale
    toward 1, and the stored value keeps its precision near a scale of 1."""

    def __init__(self, hidden_size: int, eps: float, dtype=None, device=None):
        super().__init__(hidden_size, eps=eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


ZERO_CENTRED_NORM_WEIGHTS = ("input_layernorm.weight", "post_attention_layernorm.weight", "final_norm.weight")


def norm_scales_from_stored(tensors: dict[str, torch.Tensor], cfg: GPTConfig, sign: int = 1) -> dict:
    """Whole tensors with each norm weight as the scale it applies: stored + 1 under ``--apply-layernorm-1p``
    (the HF formats hold the scale); ``sign=-1``: the inverse, scales back to stored values. Other
    tensors, and every tensor of a model without the flag, are returned as they are."""
    if not cfg.apply_layernorm_1p:
        return dict(tensors)
    return {name: t + sign if name.endswith(ZERO_CENTRED_NORM_WEIGHTS) else t for name, t in tensors.items()}


class LayerContext:
    """What every submodule needs to know about the layout (one shared object per chunk, not a global)."""

    def __init__(self, cfg: GPTConfig, groups: ModelParallelGroups, rng: TensorParallelRNG, dtype, device):
        tp_group = groups.tp.group if groups.tp.size > 1 else None
        sequence_parallel = groups.sequence_parallel and groups.tp.size > 1
        self.cfg, self.tp_group, self.sp, self.rng = cfg, tp_group, sequence_parallel, rng
        self.dtype, self.device = dtype, device
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        # Dropout on replicated activations uses the stream shared by tp ranks; on a sequence chunk
        # (sequence parallel) each rank holds different tokens, so it uses the per-rank stream.
        self.hidden_region = TensorParallelRNG.TP if sequence_parallel else TensorParallelRNG.DEFAULT
        self.rotary = RotaryEmbedding(cfg) if cfg.position_embedding_type == "rope" else None
        # Expert parallelism (MoE layers); the MoE all-to-all's bytes are recorded in comm_log (tag "ep"), the
        # context-parallel attention's (tag "cp") too: the model's own log, apart from the trainer's dp bytes.
        ep = groups.ep
        self.ep_group, self.ep_size, self.ep_rank = (ep.group, ep.size, ep.rank) if ep.size > 1 else (None, 1, 0)
        self.comm_log = CommLog()
        self.recompute_modules = selective_modules(cfg)        # --recompute-modules (selective), or none
        # Context parallelism: this rank holds two chunks of each sequence (megazero.parallel.context).
        self.cp = groups.cp if groups.cp.size > 1 else None
        self.cp_comm_type = groups.cp_comm_type

    def positions(self, local_length: int, device) -> torch.Tensor | None:
        """The positions of this cp rank's ``local_length`` tokens (None without context parallelism)."""
        if self.cp is None:
            return None
        return rank_positions(local_length * self.cp.size, self.cp.rank, self.cp.size, device)

    def recomputes(self, module: str, cache: LayerKVCache | None = None) -> bool:
        """Is ``module`` (a ``--recompute-modules`` name) recomputed in this forward? Only when autograd
        records one (not in evaluation or generation)."""
        return module in self.recompute_modules and cache is None and torch.is_grad_enabled()

    def dropout(self, x, p: float, training: bool, region: str):
        if not training or p == 0.0:
            return x
        with self.rng.fork(region):
            return F.dropout(x, p, training=True)

    def norm(self, fused: bool | None = None) -> nn.Module:
        """The configured normalisation over h (replicated; its gradient is partial under SP): apex's
        fused kernel on CUDA when the real apex is installed (``fused``; default: whenever it can,
        :mod:`megazero.kernels`), else torch's. Either has the parameters ``weight`` (and ``bias``).
        Zero-centred norms (``--apply-layernorm-1p``) are always torch's: apex's modules scale by
        ``weight`` itself."""
        cfg, kw = self.cfg, dict(dtype=self.dtype, device=self.device)
        zero_centred = cfg.apply_layernorm_1p
        if not zero_centred and (fused if fused is not None else use_apex_norms(self.rng.device)):
            norm = apex_norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon, **kw)
        elif cfg.normalization == "RMSNorm":
            norm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon, zero_centred=zero_centred, **kw)
        elif zero_centred:
            norm = ZeroCentredLayerNorm(cfg.hidden_size, cfg.layernorm_epsilon, **kw)
        else:
            norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, **kw)
        for p in norm.parameters():
            set_tp_attributes(p, False, sequence_parallel_grad=self.sp)
        norm.is_norm = True          # apex's modules are plain Modules: the model's init finds its norms by this
        return norm

    def linear_kw(self) -> dict:
        return dict(sequence_parallel=self.sp, dtype=self.dtype, device=self.device)


class Embedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings, then dropout. ids [b, s] -> [s(/tp), b, h].

    Without learned positions (RoPE) only the word embedding; ``offset`` is the position of the first
    token (a KV cache's length during generation)."""

    def __init__(self, ctx: LayerContext, padded_vocab_size: int, with_positions: bool = True):
        super().__init__()
        self.ctx = ctx
        cfg = ctx.cfg
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size, ctx.tp_group,
                                                      sequence_parallel=ctx.sp, dtype=ctx.dtype,
                                                      device=ctx.device)
        self.position_embeddings = None
        if with_positions and cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                    dtype=ctx.dtype, device=ctx.device)
            set_tp_attributes(self.position_embeddings.weight, False, sequence_parallel_grad=ctx.sp)

    def forward(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        ctx, s = self.ctx, ids.shape[1]
        if offset + s > ctx.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {offset + s} exceeds {FLAG.max_position_embeddings} "
                             f"{ctx.cfg.max_position_embeddings}")
        if ctx.sp:
            words = self.word_embeddings(ids)      # [s/tp, b, h]: this rank's sequence chunk
            chunk = s // ctx.tp_size
            first = offset + ctx.tp_rank * chunk
        else:
            words = self.word_embeddings(ids.t())  # [s, b, h]: looked up sequence-first, no transpose copy
            chunk, first = s, offset
        x = words
        if self.position_embeddings is not None:
            positions = ctx.positions(s, ids.device)          # a cp rank's two chunks of the sequence
            if positions is None:
                positions = torch.arange(first, first + chunk, device=ids.device)
            else:
                positions = positions[first:first + chunk]
            x = words + self.position_embeddings(positions).unsqueeze(1)
        return ctx.dropout(x, ctx.cfg.hidden_dropout, self.training, ctx.hidden_region)


def attend(ctx: LayerContext, q, k, v, cache: LayerKVCache | None, training: bool) -> torch.Tensor:
    """Causal attention of ``q`` [s, b, heads, d] over ``k`` [s, b, kv_heads, d], ``v`` [s, b, kv_heads, d_v]
    (kv_heads divides heads; query head i uses key/value head i // (heads / kv_heads); d_v is d except in
    latent attention), after RoPE when configured (on the first ``rotary_dim`` features of q and k) and with
    the cached keys/values in front; returns [s, b, heads * d_v]."""
    s, b, heads, _ = q.shape
    if ctx.cp is not None:                    # this cp rank's two chunks of the sequence
        if ctx.rotary is not None:
            positions = ctx.positions(s, q.device)
            q, k = ctx.rotary(q, positions=positions), ctx.rotary(k, positions=positions)
        return context_parallel_attention(q, k, v, ctx.cp, ctx.cp_comm_type, ctx.comm_log).reshape(s, b, -1)
    offset = cache.owner.length if cache is not None else 0
    if ctx.rotary is not None:
        q, k = ctx.rotary(q, offset), ctx.rotary(k, offset)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))                    # [b, heads, s, d]
    if cache is not None:
        k, v = cache.append(k, v)                                          # [b, kv_heads, offset + s, d]
    kw = dict(is_causal=True)
    if offset and s > 1:                  # new queries see every cached key and the causal part of their own
        kw = dict(attn_mask=torch.ones(s, offset + s, dtype=torch.bool, device=q.device).tril(offset))
    elif offset:
        kw = {}
    k, v = grouped_key_values(k, v, heads, kw)
    p = ctx.cfg.attention_dropout if training else 0.0
    if p > 0.0:
        with ctx.rng.fork(TensorParallelRNG.TP):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **kw)
    else:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def core_attention(ctx: LayerContext, q, k, v, cache: LayerKVCache | None, training: bool) -> torch.Tensor:
    """:func:`attend`, keeping only ``q``, ``k``, ``v`` (views of the projections' outputs) for the
    backward under ``--recompute-modules core_attn``."""
    if not ctx.recomputes("core_attn", cache):
        return attend(ctx, q, k, v, cache, training)
    rng = ctx.rng if training and ctx.cfg.attention_dropout > 0 else None
    return checkpointed(lambda q_, k_, v_: attend(ctx, q_, k_, v_, None, training), rng, q, k, v)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with heads split across tp ranks (GPT-2, and Llama without GQA).

    Fused QKV layout. The FULL ``qkv.weight`` [3h, h] (and ``qkv.bias`` [3h]) is ordered head by
    head, q, k, v inside each head (head_dim d = h / heads)::

        row  head*3d + 0*d + j   -> query  feature j of head `head`
        row  head*3d + 1*d + j   -> key    feature j of head `head`
        row  head*3d + 2*d + j   -> value  feature j of head `head`

    tp rank r holds the contiguous rows ``r*3h/tp .. (r+1)*3h/tp - 1``, i.e. whole heads
    ``r*heads/tp .. (r+1)*heads/tp - 1`` each as [q; k; v]. This full layout does not depend on tp.
    Worked example, h=4, 2 heads (d=2), tp=2: full rows are
    ``[q0 q0 k0 k0 v0 v0 | q1 q1 k1 k1 v1 v1]``; tp rank 0 holds rows 0-5 (head 0), rank 1 rows 6-11.
    HF GPT-2's ``c_attn.weight`` is [h, 3h] with columns [Q_all | K_all | V_all]: ours is
    ``qkv_blocks_to_interleaved(c_attn.weight.t(), heads)`` (bias likewise, without the transpose);
    HF Llama's is ``qkv_blocks_to_interleaved(cat([q_proj, k_proj, v_proj]), heads)``.
    ``dense`` ([h, h], split on dim 1) takes the heads' outputs concatenated in head order, the same
    order as HF ``c_proj``'s / ``o_proj``'s input features.
    """

    def __init__(self, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        cfg = ctx.cfg
        h = cfg.hidden_size
        self.heads_local = cfg.num_attention_heads // ctx.tp_size
        self.head_dim = cfg.head_dim
        self.qkv = ColumnParallelLinear(h, 3 * h, ctx.tp_group, bias=cfg.qkv_bias, **ctx.linear_kw())
        self.dense = RowParallelLinear(h, h, ctx.tp_group, bias=cfg.add_bias_linear, **ctx.linear_kw())

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        qkv = self.qkv(x)                                               # [s, b, heads_local*3*d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.heads_local, 3, self.head_dim)
        q, k, v = qkv.unbind(3)                     # [s, b, heads_local, d]; backward: one stack
        return self.dense(core_attention(self.ctx, q, k, v, cache, self.training))


class ReplicatedLinear(nn.Module):
    """``nn.Linear`` whose weight every tp rank holds whole but uses only part of: each rank's gradient
    is partial, so it is marked ``sequence_parallel_grad`` (summed over tp after backward, like a
    norm's under sequence parallelism). The key/value heads when there are fewer groups than tp ranks."""

    def __init__(self, in_features: int, out_features: int, partial_grad: bool, bias: bool, dtype, device):
        super().__init__()
        kw = dict(tensor_parallel=False, sequence_parallel_grad=partial_grad, dtype=dtype, device=device)
        self.weight = new_parameter((out_features, in_features), **kw)
        self.bias = new_parameter((out_features,), zeros=True, **kw) if bias else None


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): ``heads`` query heads share ``G`` key/value
    heads, query head i using group i // (heads / G). Unfused query and fused key/value projections.

    Full (tp=1) layouts, d = head_dim::

        query.weight      [heads*d, h]  head by head: row i*d + j = feature j of query head i (HF q_proj)
        key_value.weight  [2*G*d, h]    group by group, key then value inside a group:
                                        row g*2d + j = key feature j of group g, row g*2d + d + j = value
        dense.weight      [h, heads*d]  input features in query-head order (HF o_proj)

    Tensor parallel (Megatron's rule; the biases, with --add-qkv-bias, follow their weights):

    - G >= tp (G % tp == 0): ``query`` and ``key_value`` are column-parallel (split dim 0); rank r holds
      query heads r*heads/tp .. and groups r*G/tp .., exactly the groups its query heads use.
    - G < tp (tp % G == 0): ``query`` is split, ``key_value`` is replicated: every rank holds all G
      groups and computes only group r*G/tp, the one its query heads use; its gradient is partial
      (only that group's rows) and is summed over tp after backward (``sequence_parallel_grad``).

    Worked example, heads=4, G=2, d=2 (query rows q0 q0 q1 q1 q2 q2 q3 q3; key_value rows
    k0 k0 v0 v0 k1 k1 v1 v1; heads 0-1 use group 0)::

        tp=2: rank 0 query rows 0-3 (heads 0, 1), key_value rows 0-3 (group 0); rank 1 rows 4-7 / 4-7
        tp=4: rank r query rows 2r..2r+1 (head r); key_value all 8 rows on every rank, ranks 0-1 use
              rows 0-3 (group 0), ranks 2-3 rows 4-7 (group 1)

    The input is gathered once (all-gather under sequence parallelism) for both projections.
    """

    def __init__(self, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        cfg, tp = ctx.cfg, ctx.tp_size
        h, d, groups = cfg.hidden_size, cfg.head_dim, cfg.num_query_groups
        self.heads_local, self.head_dim = cfg.num_attention_heads // tp, d
        self.kv_replicated = groups < tp
        self.groups_local = 1 if self.kv_replicated else groups // tp
        self.kv_rows = None
        if self.kv_replicated:
            group = ctx.tp_rank * groups // tp
            self.kv_rows = slice(group * 2 * d, (group + 1) * 2 * d)
        kw = ctx.linear_kw()
        self.query = ColumnParallelLinear(h, cfg.num_attention_heads * d, ctx.tp_group, bias=cfg.qkv_bias, **kw)
        if self.kv_replicated:
            self.key_value = ReplicatedLinear(h, 2 * groups * d, True, cfg.qkv_bias, ctx.dtype, ctx.device)
        else:
            self.key_value = ColumnParallelLinear(h, 2 * groups * d, ctx.tp_group, bias=cfg.qkv_bias, **kw)
        self.dense = RowParallelLinear(cfg.num_attention_heads * d, h, ctx.tp_group, bias=cfg.add_bias_linear, **kw)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        ctx = self.ctx
        x = gather_from_sequence_parallel_region(x, ctx.tp_group) if ctx.sp else copy_to_tp_region(x, ctx.tp_group)
        q = linear(x, self.query.weight, self.query.bias, self.query.fp8)
        kv_weight, kv_bias = self.key_value.weight, self.key_value.bias
        if self.kv_replicated:                        # this rank's group only
            kv_weight, kv_bias = kv_weight[self.kv_rows], kv_bias[self.kv_rows] if kv_bias is not None else None
        kv = linear(x, kv_weight, kv_bias, getattr(self.key_value, "fp8", None))   # replicated: never FP8
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads_local, self.head_dim)
        kv = kv.view(s, b, self.groups_local, 2, self.head_dim)
        k, v = kv.unbind(3)                                             # backward: one stack
        return self.dense(core_attention(ctx, q, k, v, cache, self.training))


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GELU -> h (row-parallel); or with ``--swiglu``
    h -> 2*ffn -> silu(gate) * up -> h.

    SwiGLU's fused ``dense_h_to_4h.weight`` [2*ffn, h] interleaves gate and up row by row: full row
    2j is gate feature j, row 2j+1 up feature j (HF: ``gate_up_to_interleaved(gate_proj, up_proj)``).
    Any contiguous chunk then holds matching gate and up rows, so tp rank r's rows
    ``r*2ffn/tp ..`` are the gate and up of its ffn features ``r*ffn/tp ..`` at every tp, and the
    full tensor does not depend on tp. Worked example, ffn=4, tp=2: full rows
    ``[g0 u0 g1 u1 | g2 u2 g3 u3]``; rank 1 holds g2 u2 g3 u3 and the down projection's columns 2-3.
    The forward multiplies by the even and the odd rows separately (strided views, no copy), so gate
    and up come out contiguous; the input is gathered once for both.
    """

    names = ("dense_h_to_4h", "dense_4h_to_h")          # the two linears' attribute (parameter) names

    def __init__(self, ctx: LayerContext, ffn_hidden_size: int | None = None):
        super().__init__()
        cfg = ctx.cfg
        ffn = ffn_hidden_size or cfg.ffn_hidden_size
        self.ctx, self.swiglu = ctx, cfg.swiglu
        width = 2 * ffn if cfg.swiglu else ffn
        kw, bias = ctx.linear_kw(), cfg.add_bias_linear
        setattr(self, self.names[0], ColumnParallelLinear(cfg.hidden_size, width, ctx.tp_group, bias=bias, **kw))
        setattr(self, self.names[1], RowParallelLinear(ffn, cfg.hidden_size, ctx.tp_group, bias=bias, **kw))
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc_in, fc_out = (getattr(self, name) for name in self.names)
        if not self.swiglu:
            return fc_out(F.gelu(fc_in(x), approximate=self.approximate))
        ctx, w, b = self.ctx, fc_in.weight, fc_in.bias
        x = gather_from_sequence_parallel_region(x, ctx.tp_group) if ctx.sp else copy_to_tp_region(x, ctx.tp_group)
        if fc_in.fp8 is not None:                        # one FP8 product, one scale for gate and up
            both = linear(x, w, b, fc_in.fp8)
            gate, up = both[..., 0::2], both[..., 1::2]
        else:
            gate, up = gate_up(x, w, b)
        return fc_out(swiglu(gate, up))


class SharedExpertMLP(MLP):
    """An MoE layer's shared experts (``--moe-shared-expert-intermediate-size`` S): the dense MLP of width
    S, tensor-split over tp the same way, its linears named ``fc1`` ([S, h], [2S, h] with --swiglu: gate/up
    rows interleaved) and ``fc2`` ([h, S]) as an expert's are."""

    names = ("fc1", "fc2")

    def __init__(self, ctx: LayerContext):
        super().__init__(ctx, ctx.cfg.moe_shared_expert_intermediate_size)


class TransformerLayer(nn.Module):
    """One pre-norm block on [s(/tp), b, h]: x + Attn(Norm(x)), then x + MLP(Norm(x)) (with dropout).
    The MLP is a :class:`megazero.models.gpt.moe.MoELayer` when global layer ``layer_id`` is an MoE layer."""

    def __init__(self, ctx: LayerContext, layer_id: int = 0):
        super().__init__()
        self.ctx = ctx
        self.input_layernorm = ctx.norm()
        self.attention = self.build_attention(ctx)
        self.post_attention_layernorm = ctx.norm()
        self.mlp_is_moe = ctx.cfg.is_moe_layer(layer_id)
        shared = SharedExpertMLP(ctx) if self.mlp_is_moe and ctx.cfg.moe_shared_expert_intermediate_size else None
        self.mlp = MoELayer(ctx, shared) if self.mlp_is_moe else MLP(ctx)

    def build_attention(self, ctx: LayerContext) -> nn.Module:
        """The layer's attention (a family built on GPT's layer returns its own here)."""
        return GroupedQueryAttention(ctx) if ctx.cfg.group_query_attention else SelfAttention(ctx)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        ctx, p = self.ctx, self.ctx.cfg.hidden_dropout
        x = x + ctx.dropout(self._normed(self.input_layernorm, self.attention, x, cache), p, self.training,
                            ctx.hidden_region)
        return x + ctx.dropout(self._normed(self.post_attention_layernorm, self._mlp, x, cache), p, self.training,
                               ctx.hidden_region)

    def _normed(self, norm: nn.Module, block, x: torch.Tensor, cache: LayerKVCache | None) -> torch.Tensor:
        """``block(norm(x))``; under ``--recompute-modules layernorm`` the norm's output is not kept."""
        if not self.ctx.recomputes("layernorm", cache):
            return block(norm(x), cache)
        y = norm(x)
        out = block(y, cache)
        free_until_backward(y, out, lambda: norm(x))
        return out

    def _mlp(self, x: torch.Tensor, cache: LayerKVCache | None) -> torch.Tensor:
        """The MLP (or MoE layer); a dense MLP keeps only its input under ``--recompute-modules mlp``."""
        if self.ctx.recomputes("mlp", cache) and not self.mlp_is_moe:
            return checkpointed(self.mlp, None, x)                   # no dropout inside the MLP
        return self.mlp(x)
