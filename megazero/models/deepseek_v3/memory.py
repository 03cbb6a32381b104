"""The DeepSeek-V3 family's activation memory, counted for this implementation (what the memory estimator
uses for this family; the GPT family's count, which it extends: :mod:`megazero.models.gpt.memory`).

A layer keeps GPT's norm inputs and outputs, statistics and MLP (or MoE) activations; its attention, multi-head
latent attention (:mod:`.attention`), keeps per token (n heads, t tp, n_t = n / t; e bytes an element)::

    q_a_proj's output and its norm's output        2 R_q        (with --q-lora-rank; every tp rank, every token)
    kv_a_proj_with_mqa's output (latent, k_r)      R_kv + D_r   (kept whole: the latent norm keeps a view)
    the normed latent (kv_b_proj's input)          R_kv
    the query and the key, RoPE applied            2 n_t (D_nope + D_r)
    kv_b_proj's output (the values are a view)     n_t (D_nope + D_v)
    the attention output (o_proj's input)          n_t D_v
    the latent norms' statistics                   fp32, one per token each (one without --q-lora-rank)

and the attention core its log-sum-exp (fp32, n_t s per sequence) where a fused kernel runs: on CUDA, or where
D_v = D_nope + D_r; on a CPU with D_v != D_nope + D_r, or with attention dropout, the unfused path keeps the
s x s probabilities (and with dropout the dropped ones and the mask). The down-projections are replicated over
tp: every rank keeps their outputs for the whole sequence, also under sequence parallelism (they read the
gathered input). ``--recompute-modules core_attn`` keeps the query and key before RoPE instead (as many
elements) and drops the core's part.

The last pipeline stage's multi-token prediction modules (:mod:`.mtp`) keep, per module and micro-batch: the
shifted token ids (int64), the embedding's output and the two norms' statistics (``hnorm``'s input is the
previous hidden state, already kept by the previous head's final norm), the concatenation ``eh_proj`` reads
(2h), a dense decoder layer (as any layer, selective recompute included; full recompute does not reach it),
and a head's activations (:func:`~megazero.models.gpt.memory.head_activation_bytes`).
"""
from __future__ import annotations

from megazero.models.gpt.memory import (
    GPTActivations,
    head_activation_bytes,
    layer_activation_bytes,
)


def latent_attention_parts(job, e: int, mask: int) -> dict[str, int]:
    """Bytes one latent attention keeps for backward per micro-batch (see the module docstring), by what keeps
    them, in :func:`megazero.models.gpt.memory.attention_parts`' terms (``attention_rope`` is 0: the rotated
    query and key replace the concatenations they are made from). ``mask`` is the estimator's dropout-mask
    element size, ``e`` on a CPU (which decides the attention kernel)."""
    cfg, t = job.model, job.parallel.tp
    s, b = cfg.seq_length, job.train.micro_batch_size
    tokens, heads = s * b, cfg.num_attention_heads // t
    query_key = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    latents, norms = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim + cfg.kv_lora_rank, 1
    if cfg.q_lora_rank is not None:
        latents, norms = latents + 2 * cfg.q_lora_rank, 2
    heads_kept = heads * (2 * query_key + cfg.qk_head_dim + 2 * cfg.v_head_dim)
    on_cpu = mask == e
    if cfg.attention_dropout > 0:
        core = b * heads * s * s * (2 * e + mask)          # probabilities, dropped, mask
    elif on_cpu and cfg.v_head_dim != query_key:
        core = e * b * heads * s * s                       # the unfused path's probabilities
    else:
        core = 4 * b * heads * s                           # the fused kernel's log-sum-exp
    return {"attention_latents": e * tokens * latents + norms * 4 * tokens,
            "attention_projections": e * tokens * heads_kept, "attention_rope": 0, "attention_core": core}


def mtp_module_bytes(job, e: int, mask: int, module: int) -> int:
    """Bytes MTP module ``module`` (0-based) keeps for backward per micro-batch on the last stage (see the
    module docstring)."""
    cfg, par = job.model, job.parallel
    s, b, h, t = cfg.seq_length, job.train.micro_batch_size, cfg.hidden_size, par.tp
    rows = s * b // t if par.sequence_parallel and t > 1 else s * b
    own = 8 * s * b + e * rows * h + 2 * 4 * rows + e * rows * 2 * h    # ids, embedding, norms' stats, eh_proj input
    layer, _ = layer_activation_bytes(job, e, mask, cfg.num_layers + module)
    return own + layer + head_activation_bytes(job, e)


class DeepSeekV3Activations(GPTActivations):
    """The family's activation model: GPT's, with latent attention's parts and the MTP modules on the last
    stage (see the module docstring)."""

    def attention_parts(self, job, e: int, mask: int) -> dict[str, int]:
        return latent_attention_parts(job, e, mask)

    def held(self, job, placement, e: int, mask: int) -> int:
        """GPT's chunk, and on the last stage the MTP modules."""
        out = super().held(job, placement, e, mask)
        if placement.post_process:
            out += sum(mtp_module_bytes(job, e, mask, k) for k in range(job.model.mtp_depth))
        return out
