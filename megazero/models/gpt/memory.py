"""The GPT family's activation memory, counted for this implementation (what the memory estimator uses
for ``--model-family gpt``; the generic formula and the protocol: :mod:`megazero.spec.activations`).

Per layer and micro-batch, the tensors autograd keeps (:func:`layer_parts`), in units of sbh elements
of e bytes (s sequence, b micro-batch, h hidden, f ffn, t tp, a heads)::

    without sequence parallel   4 sbh + (4 sbh + 2 sbf) / t        (x, LN outputs, x after attention,
    with sequence parallel      2 sbh + (6 sbh + 2 sbf) / t         qkv, attention out, MLP in/out; SP
                                                                    stores the gathered inputs of the
                                                                    column-parallel layers)

for GPT-2; the Llama-family layers change the attention and MLP terms (per token: RoPE keeps the rotated
queries and keys, grouped-query attention 2h/t + 2Gd/t (+ Gd/t rotated keys) instead of 4h/t, SwiGLU
3f/t instead of 2f/t: gate, up and the product, :func:`megazero.kernels.swiglu` keeping no silu(gate)) and
RMSNorm keeps one statistic per row instead of two; plus the layer norms' statistics (fp32), the
attention's log-sum-exp (fp32; the fused kernel keeps no s x s scores, except with attention dropout,
where the unfused path keeps the probabilities and the mask), dropout masks and
the head's softmax (fp32, sbV/t). An MoE layer is counted as one dense MLP (router, top-k copies and
all-to-all buffers left out), plus, under ``--moe-grouped-gemm``, the copy of its local experts' weights
stacked in forward and kept until its backward (:func:`grouped_gemm_stacked_bytes`).

The recompute and offload choices (:mod:`megazero.spec.recompute`) change what a layer keeps
(:func:`selective_savings` says what each ``--recompute-modules`` entry drops) and what a chunk holds:
a fully recomputed group keeps its input only, and its backward brings the group's activations back
(the working set); an offloaded layer's bytes wait in host memory (:func:`chunk_offloaded_bytes`).
"""
from __future__ import annotations

from megazero.parallel.tensor import linear_cross_entropy_chunk
from megazero.spec.activations import TransformerActivations
from megazero.spec.recompute import full_recompute_groups, selective_modules
from megazero.spec.registry import get_model_spec


def attention_elements(cfg, t: int) -> int:
    """Elements per token one tp rank's attention keeps: the fused QKV output (its value part is a view
    SDPA saves), or the query and the key/value projection outputs (G >= t groups split, one group per
    rank when replicated); RoPE's rotated queries and keys instead of the projections' views; the output."""
    return _attention_projection_elements(cfg, t) + _rope_elements(cfg, t)


def _attention_projection_elements(cfg, t: int) -> int:
    """What the attention keeps with its core recomputed: the projections' outputs (the core's inputs)
    and the core's output (the dense layer's input)."""
    h, d = cfg.hidden_size, cfg.head_dim
    if not cfg.group_query_attention:
        return 4 * h // t
    return 2 * h // t + 2 * max(cfg.num_query_groups // t, 1) * d


def _rope_elements(cfg, t: int) -> int:
    """RoPE's rotated queries and keys, net of the projection outputs they replace (per token)."""
    if cfg.position_embedding_type != "rope":
        return 0
    if not cfg.group_query_attention:
        return 2 * cfg.hidden_size // t
    return max(cfg.num_query_groups // t, 1) * cfg.head_dim


def mlp_elements(cfg, t: int) -> int:
    """Elements per token one tp rank's MLP keeps: GELU's input and output; or SwiGLU's gate and up (2 ffn,
    kept by :func:`megazero.kernels.swiglu`, which makes silu(gate) again in backward) and the product fed
    to the down projection."""
    return (3 if cfg.swiglu else 2) * cfg.ffn_hidden_size // t


def moe_mlp_elements(cfg, t: int, sp: bool) -> tuple[int, int]:
    """Elements per token (of the layer's s*b) one tp rank's MoE layer keeps, routing balanced: (routed,
    shared). Routed: each of the top-k experts' inner activations, ``--moe-ffn-hidden-size`` wide; experts
    are whole on every tp rank, which routes all tokens, or its s*b/tp under sequence parallelism. Shared:
    the shared experts' (``--moe-shared-expert-intermediate-size``), tensor-split like a dense MLP."""
    per_width = 3 if cfg.swiglu else 2
    routed = cfg.moe_router_topk * per_width * cfg.expert_ffn_hidden_size // (t if sp else 1)
    return routed, per_width * (cfg.moe_shared_expert_intermediate_size or 0) // t


def _linears(cfg, t: int) -> list[tuple[str, int, int, str]]:
    """One layer's column- and row-parallel linears on one tp rank: (name, local in features, local out
    features, the input they keep: ``attention`` / ``mlp`` a norm's output, ``core`` the attention output,
    ``inner`` the MLP's inner activation); replicated key/value heads (fewer groups than tp) with 0 out
    features: they never run in FP8."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    if cfg.group_query_attention:
        kv = 2 * cfg.num_query_groups * cfg.head_dim // t if cfg.num_query_groups >= t else 0
        attention = [("query", h, h // t, "attention"), ("key_value", h, kv, "attention")]
    else:
        attention = [("query_key_value", h, 3 * h // t, "attention")]
    return attention + [("dense", h // t, h, "core"), ("fc1", h, (2 if cfg.swiglu else 1) * f // t, "mlp"),
                        ("fc2", f // t, h, "inner")]


def fp8_linears(job) -> list[tuple[str, int, int, str]]:
    """One layer's linears that run in FP8 on one tp rank (as :func:`_linears`); empty without FP8. As
    :func:`megazero.parallel.fp8.suits_fp8` and the model's ``fp8_layers``: local sizes multiples of 16."""
    if not job.fp8.enabled:
        return []
    return [x for x in _linears(job.model, job.parallel.tp) if x[1] % 16 == 0 and x[2] % 16 == 0 and x[2] > 0]


def fp8_saved_bytes(job, e: int) -> int:
    """Bytes one layer's FP8 linears change in what it keeps for backward per micro-batch (negative: less).
    Under the tensor-wise and delayed recipes each FP8 linear keeps its input and its weight cast to FP8
    (1 byte an element) instead of the input in e bytes and the weight itself (a parameter, no new bytes):
    an input's high-precision tensor is freed when every linear reading it runs in FP8 (the query and
    key/value projections reading one norm output each keep an FP8 copy of it) and nothing else keeps it:
    the attention output, the dense layer's input, stays (the attention core keeps it for its own
    backward). The FP8 weight copy is new. Row-wise keeps the high-precision input and weight (cast again along the other dimension in
    the backward): no change."""
    fp8 = fp8_linears(job)
    if not fp8 or job.fp8.recipe == "rowwise":
        return 0
    cfg, t = job.model, job.parallel.tp
    tokens = cfg.seq_length * job.train.micro_batch_size
    width = {"attention": cfg.hidden_size, "mlp": cfg.hidden_size, "inner": cfg.ffn_hidden_size // t}
    names = {name for name, _, _, _ in fp8}
    freed = sum(tokens * w for kind, w in width.items()
                if all(name in names for name, _, _, k in _linears(cfg, t) if k == kind))
    return sum(tokens * k + k * n for _, k, n, _ in fp8) - e * freed


def fp8_head_bytes(job, e: int) -> int:
    """``--fp8-head`` (tensor-wise or delayed): what the output layer's FP8 product changes in what the last
    chunk keeps per micro-batch: its input in FP8 instead of e bytes (the final norm's output, kept by
    nothing else) and the FP8 copy of its tp-local weight; 0 where the local vocabulary or the hidden size
    is not a multiple of 16 (the head then stays in the parameters' precision)."""
    cfg, t, fp8 = job.model, job.parallel.tp, job.fp8
    vocab, h = cfg.padded_vocab_size(t) // t, cfg.hidden_size
    if not (fp8.enabled and fp8.fp8_head) or fp8.recipe == "rowwise" or vocab % 16 or h % 16:
        return 0
    tokens = cfg.seq_length * job.train.micro_batch_size
    return tokens * h * (1 - e) + vocab * h


def attention_parts(job, e: int, mask: int) -> dict[str, int]:
    """Bytes one layer's attention keeps for backward per micro-batch (recomputing nothing), by what keeps
    them: ``attention_projections`` the projections' outputs and the core's output, ``attention_rope`` RoPE's
    rotated queries and keys beyond them, ``attention_core`` the core's statistics or dropout probabilities
    (``--recompute-modules core_attn`` drops the last two)."""
    cfg, t = job.model, job.parallel.tp
    s, b, a = cfg.seq_length, job.train.micro_batch_size, cfg.num_attention_heads
    return {
        "attention_projections": e * s * b * _attention_projection_elements(cfg, t),
        "attention_rope": e * s * b * _rope_elements(cfg, t),
        "attention_core": (b * (a // t) * s * s * (2 * e + mask) if cfg.attention_dropout > 0
                           else 4 * b * (a // t) * s),    # unfused probabilities, dropped, mask; or the lse
    }


def family_attention_parts(job, e: int, mask: int) -> dict[str, int]:
    """:func:`attention_parts`, or those of the job's family where its activation model (a subclass of
    :class:`GPTActivations`, registered in its spec) counts another attention."""
    model = get_model_spec(job.model.model_family).activation_bytes
    return (model.attention_parts if isinstance(model, GPTActivations) else attention_parts)(job, e, mask)


def layer_parts(job, e: int, mask: int) -> dict[str, int]:
    """Bytes one layer keeps for backward per micro-batch, by what keeps them (recomputing nothing).
    ``mask``: bytes per element of a dropout mask (1 for CUDA's fused dropout, e on a CPU)."""
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    sp = par.sequence_parallel and t > 1
    rows = s * b // t if sp else s * b                    # the rows a layer norm (and dropout) sees
    stats = 2 if cfg.normalization == "LayerNorm" else 1  # LayerNorm: mean and rstd; RMSNorm: rstd
    parts = {
        "norm_inputs": e * 2 * rows * h,                  # x and x after attention (the norms keep them)
        "linear_inputs": e * 2 * s * b * h,               # the norms' outputs, or (SP) their gathered copies
        "norm_stats": 2 * stats * 4 * rows,
        **family_attention_parts(job, e, mask),
        "mlp_inner": e * s * b * mlp_elements(cfg, t),
        "dropout_masks": 2 * rows * h * mask if cfg.hidden_dropout > 0 else 0,
        "fp8": fp8_saved_bytes(job, e),                   # FP8 inputs and weights, less what they replace
    }
    return parts


def selective_savings(job, parts: dict[str, int]) -> dict[str, int]:
    """Bytes per layer and micro-batch each ``--recompute-modules`` entry in use stops keeping:
    core_attn the rotated queries/keys and the core's statistics (or dropout probabilities); mlp the
    inner activations (and under SP fc1's gathered input, keeping the sbh/t chunk instead); layernorm
    the norms' outputs (not under SP, where nothing keeps them); moe_act an MoE layer's activation
    output (GELU's, or SwiGLU's product, whose gate and up the recompute keeps: of the routed experts, when the
    layer's parts are an MoE layer's)."""
    cfg, par = job.model, job.parallel
    modules = selective_modules(cfg)
    sp = par.sequence_parallel and par.tp > 1
    sbh = parts["linear_inputs"] // 2
    out = {}
    if "core_attn" in modules:
        out["core_attn"] = parts["attention_rope"] + parts["attention_core"]
    if "layernorm" in modules and not sp:
        out["layernorm"] = parts["linear_inputs"]
    if "mlp" in modules:
        out["mlp"] = parts["mlp_inner"] + ((sbh - sbh // par.tp) if sp else 0)
    if "moe_act" in modules:
        out["moe_act"] = parts["mlp_inner"] // (3 if cfg.swiglu else 2)
    return out


def grouped_gemm_stacked_bytes(job, e: int) -> int:
    """Bytes of the stacked weights one MoE layer keeps per micro-batch under ``--moe-grouped-gemm``: its
    E/EP local experts' fc1 and fc2 weights and biases, one copy (megazero/models/gpt/moe.py,
    ``LocalExperts.grouped_forward``); 0 without the flag and where the per-expert loop runs instead
    (experts in FP8; fp64; widths whose rows are not a multiple of 16 bytes). CPU's rule: on CUDA the loop
    also runs in fp32 and fp16, which this counts as grouped."""
    cfg, par = job.model, job.parallel
    f, h = cfg.expert_ffn_hidden_size, cfg.hidden_size
    fc1 = 2 * f if cfg.swiglu else f
    experts_in_fp8 = any(name == "fc1" for name, *_ in fp8_linears(job))
    if not (cfg.num_experts and cfg.moe_grouped_gemm) or e > 4 or experts_in_fp8 or \
            any(width * e % 16 for width in (h, fc1, f)):
        return 0
    per_expert = fc1 * h + h * f + ((fc1 + h) if cfg.add_bias_linear else 0)
    return e * per_expert * (cfg.num_experts // par.expert_model_parallel_size)


def layer_activation_bytes(job, e: int, mask: int, layer_id: int | None = None) -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes of its input) per micro-batch, after the selective
    recompute in use (moe_act only on MoE layers, mlp only on dense ones, when ``layer_id`` is given; an
    MoE layer's stacked expert weights under ``--moe-grouped-gemm`` then too)."""
    cfg, par = job.model, job.parallel
    parts = layer_parts(job, e, mask)
    moe = layer_id is not None and cfg.is_moe_layer(layer_id)
    if moe:                                       # the experts' widths, top-k of them, and the shared experts
        routed, shared = moe_mlp_elements(cfg, par.tp, par.sequence_parallel and par.tp > 1)
        tokens = cfg.seq_length * job.train.micro_batch_size
        parts["mlp_inner"], parts["shared_experts_inner"] = e * tokens * routed, e * tokens * shared
    savings = selective_savings(job, parts)
    if layer_id is not None:
        savings.pop("mlp" if moe else "moe_act", None)
        parts["grouped_gemm_weights"] = grouped_gemm_stacked_bytes(job, e) if moe else 0
    rows = cfg.seq_length * job.train.micro_batch_size // (par.tp if par.sequence_parallel and par.tp > 1 else 1)
    return sum(parts.values()) - sum(savings.values()), e * rows * cfg.hidden_size


def _layers(job, placement, e: int, mask: int) -> list[tuple[list[int], bool, int, int]]:
    """The chunk's recompute groups with their bytes: (layer ids, recomputed, kept bytes, input bytes)."""
    ids = placement.layer_ids
    out = []
    for indices, recomputed in full_recompute_groups(job.model, len(ids)):
        kept = [layer_activation_bytes(job, e, mask, ids[i]) for i in indices]
        out.append(([ids[i] for i in indices], recomputed, sum(k for k, _ in kept), kept[0][1]))
    return out


def _offloaded_count(job, placement) -> int:
    cfg = job.model
    return min(cfg.cpu_offloading_num_layers or len(placement.layer_ids), len(placement.layer_ids)) \
        if cfg.cpu_offloading else 0


def chunk_layer_bytes(job, placement, e: int, mask: int) -> int:
    """Bytes the chunk's layers leave on the device per micro-batch: a recomputed group its input, a
    kept layer what it keeps, an offloaded layer nothing."""
    offloaded = _offloaded_count(job, placement)
    out = position = 0
    for ids, recomputed, kept, layer_input in _layers(job, placement, e, mask):
        if recomputed:
            out += layer_input
        elif position >= offloaded:
            out += kept
        position += len(ids)
    return out


def chunk_offloaded_bytes(job, placement, e: int, mask: int) -> int:
    """Bytes one micro-batch leaves in host memory: what the offloaded layers keep."""
    offloaded = _offloaded_count(job, placement)
    return sum(layer_activation_bytes(job, e, mask, i)[0] for i in placement.layer_ids[:offloaded])


def chunk_activation_bytes(job, placement, e: int, mask: int) -> int:
    """Bytes one micro-batch leaves held in the chunk of ``placement`` after its forward (on the device)."""
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    return chunk_layer_bytes(job, placement, e, mask) + _chunk_ends(job, placement, e, mask, s, b, h, t)


def _chunk_ends(job, placement, e, mask, s, b, h, t) -> int:
    """What the embedding, the head and the chunk's boundary keep."""
    cfg, par = job.model, job.parallel
    out = 0
    if placement.pre_process:
        out += 2 * 8 * s * b                               # token and position ids
        out += s * b * h * mask if cfg.hidden_dropout > 0 else 0     # the embedding's dropout mask
    rows = s * b // t if par.sequence_parallel and t > 1 else s * b
    if not placement.post_process:                         # the output, held by the schedule for the backward
        out += e * rows * h
    if placement.post_process:
        out += head_activation_bytes(job, e)
    return out


def head_activation_bytes(job, e: int) -> int:
    """What the final norm and the head keep for backward per micro-batch: the norm's input and statistics,
    the logits' input (gathered under sequence parallelism), the softmax (fp32) or the fused loss's
    log-sum-exp, the target and the mask."""
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    rows = s * b // t if par.sequence_parallel and t > 1 else s * b
    stats = 2 if cfg.normalization == "LayerNorm" else 1
    out = e * rows * h + stats * 4 * rows + e * s * b * h + fp8_head_bytes(job, e)
    if fused_loss(job):
        return out + 4 * s * b + 9 * s * b
    return out + 4 * s * b * cfg.padded_vocab_size(t) // t + 9 * s * b


def fused_loss(job) -> bool:
    """Does the head run the fused linear cross-entropy (``--cross-entropy-loss-fusion``, no FP8 head)?"""
    return job.model.cross_entropy_loss_fusion and not (job.fp8.fp8_format and job.fp8.fp8_head)


def fused_loss_chunk_bytes(job, e: int) -> tuple[int, int]:
    """(bytes of one chunk's logits in the loss's precision, bytes of the output layer's weight gradient
    accumulated in it) of the fused linear cross-entropy
    (:func:`megazero.parallel.tensor.vocab_parallel_linear_cross_entropy`)."""
    cfg, s, b, t = job.model, job.model.seq_length, job.train.micro_batch_size, job.parallel.tp
    vocab, acc = cfg.padded_vocab_size(t) // t, max(e, 4)
    rows = linear_cross_entropy_chunk(s * b, vocab, cfg.hidden_size)
    return rows * vocab * acc, vocab * cfg.hidden_size * acc


def weight_grad_bytes(job, placement, e: int, mask: int) -> int:
    """Bytes one micro-batch holds on the device between its I and its W (zero-bubble schedules): what
    W needs, each weight matmul's input X and output gradient dY (for GPT-2 at tp 1, 7 + 9 = 16 sbh per
    layer; X of qkv, proj, fc1 (h each) and fc2 (f); dY of qkv (3h), proj (h), fc1 (f) and fc2 (h)),
    the chunk's input; nothing of the head (the output layer's weight gradient is computed in I:
    ``split_backward.weight_grad_in_input``, so its X and the logits' gradient go then). A recomputed
    group keeps its input (W recomputes it) and its layers' dY; an offloaded layer keeps only dY on the
    device. The first virtual stage's I computes nothing (its input is token ids): it holds all until W.
    Selective recompute is counted as none (its X's come back in W)."""
    if placement.pre_process:
        return chunk_activation_bytes(job, placement, e, mask)
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    rows = s * b // t if par.sequence_parallel and t > 1 else s * b
    kv = 2 * max(cfg.num_query_groups // t, 1) * cfg.head_dim if cfg.group_query_attention else 2 * h // t
    f = cfg.ffn_hidden_size // t
    grads = e * s * b * ((h // t + kv) + h + f * (2 if cfg.swiglu else 1) + h)   # dY: qkv, proj, fc1, fc2
    inputs = e * s * b * (h + h // t + h + f)                                      # X: qkv, proj, fc1, fc2
    offloaded = _offloaded_count(job, placement)
    out = e * rows * h                                                             # the chunk's input
    position = 0
    for ids, recomputed, kept, layer_input in _layers(job, placement, e, mask):
        n = len(ids)
        if recomputed:
            out += layer_input + n * grads
        else:
            out += n * grads + (n * inputs if position >= offloaded else 0)
        position += n
    return min(out, chunk_activation_bytes(job, placement, e, mask))


def _recompute_extra(job, placement, e: int, mask: int) -> int:
    """The most a recomputed group of the chunk brings back at once: its layers' activations, less
    what the kept layers after it (their backward ran first) have already freed."""
    groups = _layers(job, placement, e, mask)
    extra = 0
    for k, (_, recomputed, kept, _) in enumerate(groups):
        if recomputed:
            extra = max(extra, kept - sum(b for _, again, b, _ in groups[k + 1:] if not again))
    return extra


class GPTActivations(TransformerActivations):
    """The GPT family's activation model (the protocol of :mod:`megazero.spec.activations`)."""

    def attention_parts(self, job, e: int, mask: int) -> dict[str, int]:
        """What one layer's attention keeps (:func:`attention_parts`); a family with another attention
        overrides it."""
        return attention_parts(job, e, mask)

    def logits(self, job, e: int) -> int:
        """The fused loss's forward makes one chunk of logits at a time (in the weights' precision, then
        the loss's); the unfused one the whole logits (the generic formula)."""
        if not fused_loss(job):
            return super().logits(job, e)
        chunk, _ = fused_loss_chunk_bytes(job, e)
        return chunk + (chunk * e // max(e, 4) if e < 4 else 0)

    def head_backward(self, job, e: int) -> int:
        """The fused loss's backward: one chunk's logits again (its gradient in the loss's precision, and
        in the weights' below float32) and the output layer's weight gradient accumulated in the loss's
        precision beside it."""
        if not fused_loss(job):
            return super().head_backward(job, e)
        chunk, weight_grad = fused_loss_chunk_bytes(job, e)
        return chunk + (chunk * e // 4 if e < 4 else 0) + weight_grad

    def layer(self, job, e: int, mask: int) -> tuple[int, int]:
        return layer_activation_bytes(job, e, mask)

    def held(self, job, placement, e: int, mask: int) -> int:
        return chunk_activation_bytes(job, placement, e, mask)

    def offloaded(self, job, placement, e: int, mask: int) -> int:
        return chunk_offloaded_bytes(job, placement, e, mask)

    def weight_grad_held(self, job, placement, e: int, mask: int) -> int:
        return weight_grad_bytes(job, placement, e, mask)

    def working(self, job, placements, e: int, mask: int, device: str = "cpu") -> int:
        """A backward's transient: the gradients passing between layers (two hidden-sized tensors and
        the MLP's inner one); what recompute brings back at once (a recomputed group's activations, or
        what a layer's recomputed modules drop: measured, they overlap within its backward); an
        offloaded layer and the one prefetched behind it, copied back (on CUDA; on a CPU the host copy is the tensor); on the last chunk, the
        head's held activations are gone first."""
        cfg, par = job.model, job.parallel
        s, b, t = cfg.seq_length, job.train.micro_batch_size, par.tp
        layer, _ = self.layer(job, e, mask)
        rows = s * b // t if par.sequence_parallel and t > 1 else s * b
        mlp_width = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
        working = e * (2 * rows * cfg.hidden_size + s * b * mlp_width // t)
        working += max((_recompute_extra(job, pl, e, mask) for pl in placements), default=0)
        working += sum(selective_savings(job, layer_parts(job, e, mask)).values())
        if cfg.cpu_offloading and device == "cuda":
            working += 2 * layer
        last = placements[-1]
        if last.post_process:
            working -= self.held(job, last, e, mask) - chunk_layer_bytes(job, last, e, mask)
        return working
