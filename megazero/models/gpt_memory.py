"""The GPT family's activation memory, counted for this implementation (what the memory estimator uses
for ``--model-family gpt``; the generic formula and the protocol: :mod:`megazero.memory.activations`).

Per layer and micro-batch, the tensors autograd keeps, in units of sbh elements of e bytes (s sequence,
b micro-batch, h hidden, f ffn, t tp, a heads)::

    without sequence parallel   4 sbh + (4 sbh + 2 sbf) / t        (x, LN outputs, x after attention,
    with sequence parallel      2 sbh + (6 sbh + 2 sbf) / t         qkv, attention out, MLP in/out; SP
                                                                    stores the gathered inputs of the
                                                                    column-parallel layers)

for GPT-2; the Llama-family layers change the attention and MLP terms (per token: RoPE keeps the rotated
queries and keys, grouped-query attention 2h/t + 2Gd/t (+ Gd/t rotated keys) instead of 4h/t, SwiGLU
4f/t instead of 2f/t) and RMSNorm keeps one statistic per row instead of two; plus the layer norms'
statistics (fp32), the attention's log-sum-exp (fp32; the fused kernel keeps no s x s scores, except
with attention dropout, where the unfused path keeps the probabilities and the mask), dropout masks and
the head's softmax (fp32, sbV/t). With ``--recompute-activations`` a layer keeps only its input, and one
layer's activations exist again during its backward. An MoE layer is counted as one dense MLP (router,
top-k copies and all-to-all buffers left out).
"""
from __future__ import annotations

from megazero.memory.activations import TransformerActivations


def attention_elements(cfg, t: int) -> int:
    """Elements per token one tp rank's attention keeps: the fused QKV output (its value part is a view
    SDPA saves), or the query and the key/value projection outputs (G >= t groups split, one group per
    rank when replicated); RoPE's rotated queries and keys instead of the projections' views; the output."""
    h, d, rope = cfg.hidden_size, cfg.head_dim, cfg.position_embedding_type == "rope"
    if not cfg.group_query_attention:
        return (4 * h + (2 * h if rope else 0)) // t
    groups = max(cfg.num_query_groups // t, 1)
    return 2 * h // t + 2 * groups * d + (groups * d if rope else 0)


def mlp_elements(cfg, t: int) -> int:
    """Elements per token one tp rank's MLP keeps: GELU's input and output; or SwiGLU's fused gate/up
    output (2 ffn), silu(gate) and the product fed to the down projection."""
    return (4 if cfg.swiglu else 2) * cfg.ffn_hidden_size // t


def layer_activation_bytes(job, e: int, mask: int) -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes of its input) per micro-batch; ``mask``: bytes per
    element of a dropout mask (1 for CUDA's fused dropout, the activation's e bytes on a CPU)."""
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    a = cfg.num_attention_heads
    sp = par.sequence_parallel and t > 1
    sbh = s * b * h
    inner = s * b * (attention_elements(cfg, t) + mlp_elements(cfg, t))
    elems = (2 * sbh + 2 * sbh // t + inner) if sp else (4 * sbh + inner)
    rows = s * b // t if sp else s * b                    # the rows a layer norm (and dropout) sees
    stats = 2 if cfg.normalization == "LayerNorm" else 1  # LayerNorm: mean and rstd; RMSNorm: rstd
    out = e * elems + 2 * stats * 4 * rows               # two norms' statistics, fp32
    if cfg.attention_dropout > 0:
        out += b * (a // t) * s * s * (2 * e + mask)       # unfused attention: probabilities, dropped, mask
    else:
        out += 4 * b * (a // t) * s                        # fused attention's log-sum-exp
    if cfg.hidden_dropout > 0:
        out += 2 * rows * h * mask                         # two dropout masks
    return out, e * rows * h


def chunk_activation_bytes(job, placement, e: int, mask: int) -> int:
    """Bytes one micro-batch leaves held in the chunk of ``placement`` after its forward."""
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    layer, layer_input = layer_activation_bytes(job, e, mask)
    n = len(placement.layer_ids)
    out = n * (layer_input if cfg.recompute_activations else layer)
    if placement.pre_process:
        out += 2 * 8 * s * b                               # token and position ids
        out += s * b * h * mask if cfg.hidden_dropout > 0 else 0     # the embedding's dropout mask
    rows = s * b // t if par.sequence_parallel and t > 1 else s * b
    if not placement.post_process:                         # the output, held by the schedule for the backward
        out += e * rows * h
    if placement.post_process:
        stats = 2 if cfg.normalization == "LayerNorm" else 1
        out += e * rows * h + stats * 4 * rows + e * s * b * h   # final norm input and stats, the logits' input
        out += 4 * s * b * cfg.padded_vocab_size(t) // t + 9 * s * b   # softmax (fp32), target, mask
    return out


class GPTActivations(TransformerActivations):
    """The GPT family's activation model (the protocol of :mod:`megazero.memory.activations`)."""

    def layer(self, job, e: int, mask: int) -> tuple[int, int]:
        return layer_activation_bytes(job, e, mask)

    def held(self, job, placement, e: int, mask: int) -> int:
        return chunk_activation_bytes(job, placement, e, mask)

    def working(self, job, placements, e: int, mask: int) -> int:
        """A backward's transient: the gradients passing between layers (two hidden-sized tensors and
        the MLP's inner one), a recomputed layer's activations; on the last chunk, the head's held
        activations are gone first."""
        cfg, par = job.model, job.parallel
        s, b, t = cfg.seq_length, job.train.micro_batch_size, par.tp
        layer, layer_input = self.layer(job, e, mask)
        rows = s * b // t if par.sequence_parallel and t > 1 else s * b
        mlp_width = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
        working = e * (2 * rows * cfg.hidden_size + s * b * mlp_width // t)
        if cfg.recompute_activations:
            working += layer
        last = placements[-1]
        if last.post_process:
            inputs = len(last.layer_ids) * (layer_input if cfg.recompute_activations else layer)
            working -= self.held(job, last, e, mask) - inputs
        return working
