"""The GPT family's model spec (``--model-family gpt``, the default): GPT-2 and, by Megatron's flags,
the Llama family and Mixture of Experts (:mod:`megazero.spec` lists what a spec supplies).

    chunks      :class:`megazero.models.gpt.GPT`, one per pipeline placement
    boundary    [s / cp, b, h], or [s / cp / tp, b, h] under sequence parallelism
    loss        the masked mean of the per-token losses
    FLOPs       :func:`flops_per_token` (6N per token plus attention, Megatron/PaLM's convention)
    hooks       MoE: the auxiliary losses' gradient scale before each step, the expert biases' update after
                it, the routing figures at each log line
    HF          GPT-2 (learned positions) <-> ``GPT2LMHeadModel``; RoPE <-> ``LlamaForCausalLM`` / Qwen2
                (:mod:`.hf_gpt2`, :mod:`.hf_llama`); HF norm weights are the scale, so zero-centred
                ones (``--apply-layernorm-1p``) gain 1 on export and lose it on import
    activations the per-implementation accounting of :mod:`.memory`
    compile     every transformer layer a region (an MoE layer: its attention), see :mod:`megazero.compile`
    experts     the parameters of ``layers.<i>.mlp.experts.<e>`` (:mod:`.moe`)
    config      :class:`~megazero.models.gpt.config.GPTConfig` (its flags and rules)
"""
from __future__ import annotations

import torch

from megazero.config import FP8Config, JobConfig, ParallelConfig, TrainConfig
from megazero.kernels import use_apex_norms
from megazero.models.gpt import hf_gpt2, hf_llama
from megazero.models.gpt.config import GPTConfig
from megazero.models.gpt.memory import GPTActivations
from megazero.models.gpt.model import GPT, activation_shape, masked_mean
from megazero.models.gpt.moe import (
    collect_moe_metrics,
    describe_moe_metrics,
    is_expert_parameter,
    start_moe_step,
    update_expert_biases,
)
from megazero.models.gpt.transformer import norm_scales_from_stored
from megazero.parallel.pipeline.generators import stage_shape
from megazero.parallel.pipeline.partition import placements
from megazero.spec import HFAdapter, ModelSpec, StepHooks, register_model_spec
from megazero.spec import build_model_chunks as build_spec_chunks
from megazero.spec.recompute import full_recompute_groups

# The GPTConfig fields a checkpoint of this family must match (shapes and meaning of its tensors).
CHECKPOINT_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "max_position_embeddings", "untie_embeddings_and_output_weights", "activation",
                     "layernorm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
                     "use_rope_scaling", "rope_scaling_factor", "normalization", "apply_layernorm_1p", "swiglu",
                     "group_query_attention", "num_query_groups", "add_bias_linear", "add_qkv_bias", "num_experts",
                     "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "moe_router_score_function")


def build_chunk(model_cfg: GPTConfig, placement, groups, *, seed: int = 1234, dtype=None, device=None,
                home_device=None) -> GPT:
    """One GPT chunk: the placement's layers, the embedding on the first stage, the head on the last."""
    return GPT(model_cfg, groups, layer_ids=placement.layer_ids, pre_process=placement.pre_process,
               post_process=placement.post_process, seed=seed, dtype=dtype or torch.float32, device=device,
               home_device=home_device)


def boundary_shape(model_cfg: GPTConfig, micro_batch_size: int, groups) -> tuple[int, int, int]:
    return activation_shape(model_cfg, micro_batch_size, groups.tp.size, groups.sequence_parallel, groups.cp.size)


def flops_per_token(cfg: GPTConfig, vocab: int, recompute: float = 0.0) -> float:
    """Training FLOPs per token: 6 * (matmul parameters) + the attention score/value term.

    Matmul parameters per layer: queries and output projection h^2 each, keys and values h*G*d each
    (G key/value heads of d features: h^2 each without grouped-query attention), MLP 2*h*ffn (3*h*ffn
    with SwiGLU's gate); plus the output layer h*V. Attention scores and values: 2 * 2 * s * h per
    layer forward (counted in full, as Megatron and PaLM do). Backward is twice forward; recompute adds
    ``recompute`` times the layers' forward (:func:`recomputed_share`: 1 = every layer again; True
    counts as 1). An MoE layer (``--num-experts``) counts the MLP of the ``--moe-router-topk`` experts a
    token passes through (``--moe-ffn-hidden-size`` wide) and of the shared experts, plus the router's h*E.
    """
    h, L, s = cfg.hidden_size, cfg.num_layers, cfg.seq_length
    total_matmul = sum(_layer_matmul(cfg, i) for i in range(L))
    return (3 + float(recompute)) * (2 * total_matmul + L * 4 * s * h) + 3 * 2 * h * vocab


def _layer_matmul(cfg: GPTConfig, layer: int, part: str = "layer") -> int:
    """Matmul parameters a token meets in global layer ``layer``: the whole layer, or its "mlp" part."""
    h, per_width = cfg.hidden_size, (3 if cfg.swiglu else 2) * cfg.hidden_size
    mlp = per_width * cfg.ffn_hidden_size
    if cfg.is_moe_layer(layer):
        shared = cfg.moe_shared_expert_intermediate_size or 0
        mlp = per_width * (cfg.moe_router_topk * cfg.expert_ffn_hidden_size + shared) + h * cfg.num_experts
    return mlp if part == "mlp" else 2 * h * h + 2 * h * cfg.kv_heads * cfg.head_dim + mlp


def recomputed_share(cfg: GPTConfig, par) -> float:
    """The forward FLOPs of all layers that the backward runs again, as a share of one forward of all
    layers (for :func:`flops_per_token`): full recompute, the recomputed layers of every chunk (block:
    the first ``--recompute-num-layers`` of each of the pp x v chunks); selective, the attention
    score/value term (core_attn) and the dense MLPs (mlp); norms and activations are not matmuls."""
    h, s, L = cfg.hidden_size, cfg.seq_length, cfg.num_layers
    per_layer = [2 * _layer_matmul(cfg, i) + 4 * s * h for i in range(L)]
    if cfg.recompute_granularity == "full":
        again = 0
        for rank in range(par.pp):
            for chunk in placements(L, par.pp, rank, par.virtual_stages, stage_shape(par)):
                groups = full_recompute_groups(cfg, len(chunk.layer_ids))
                again += sum(per_layer[chunk.layer_ids[i]] for indices, on in groups if on for i in indices)
        return again / sum(per_layer)
    if cfg.recompute_granularity == "selective":
        modules = cfg.recompute_modules
        again = L * 4 * s * h if "core_attn" in modules else 0
        if "mlp" in modules:
            again += sum(2 * _layer_matmul(cfg, i, "mlp") for i in range(L) if not cfg.is_moe_layer(i))
        return again / sum(per_layer)
    return 0.0


def describe(m: GPTConfig) -> str:
    """The Llama-family and MoE options in use, for the log line ('' for a GPT-2 shaped model)."""
    parts = [name for name, on in (
        ("fused linear cross-entropy", m.cross_entropy_loss_fusion),
        (f"RoPE (base {m.rotary_base:g})", m.position_embedding_type == "rope"),
        ("RMSNorm", m.normalization == "RMSNorm"), ("zero-centred norm weights", m.apply_layernorm_1p),
        (f"SwiGLU (ffn {m.ffn_hidden_size})", m.swiglu),
        (f"GQA ({m.kv_heads} KV heads)", m.group_query_attention), ("no biases", not m.add_bias_linear),
        ("QKV bias", m.add_qkv_bias and not m.add_bias_linear),
        ("untied output", m.untie_embeddings_and_output_weights),
        (f"MoE ({m.num_experts} experts, top-{m.moe_router_topk}, {m.moe_router_score_function}, "
         + (f"every {m.moe_layer_freq} layer(s)" if isinstance(m.moe_layer_freq, int) else
            f"layers {''.join(map(str, m.moe_layer_freq))}")
         + (f", shared experts {m.moe_shared_expert_intermediate_size}" if m.moe_shared_expert_intermediate_size
            else "")
         + (", expert bias" if m.moe_router_enable_expert_bias else "")
         + (f", capacity factor {m.moe_expert_capacity_factor:g})" if m.moe_expert_capacity_factor else ", dropless)"),
         bool(m.num_experts))) if on]
    return ", " + ", ".join(parts) if parts else ""


def moe_metrics(chunks, job, tp_rank: int, steps: int, device) -> dict:
    """The MoE routing figures of the last ``steps`` steps (a collective; MoE runs only)."""
    m = job.model
    if not m.num_experts:
        return {}
    return collect_moe_metrics(chunks, m.num_layers, m.num_experts, tp_rank, job.parallel.sequence_parallel,
                               steps, device)


def after_moe_step(chunks, job, tp_rank: int, device) -> None:
    """The expert biases' step (``--moe-router-enable-expert-bias``; a collective, else nothing)."""
    m = job.model
    if m.num_experts and m.moe_router_enable_expert_bias:
        update_expert_biases(chunks, m.num_layers, m.num_experts, tp_rank, job.parallel.sequence_parallel,
                             m.moe_router_bias_update_rate, device)


def compile_regions(chunk: GPT) -> list:
    """The modules ``--compile`` compiles in a GPT chunk: each dense transformer layer whole, and the
    attention of an MoE layer (the router's top-k and the experts' all-to-all have data-dependent shapes,
    so they run eagerly between compiled regions). RoPE's cos/sin table is built first, for the sequence
    length, so that no compiled layer finds it missing and recompiles."""
    rotary = chunk.ctx.rotary
    if rotary is not None:
        rotary.table(chunk.rng.device, chunk.ctx.dtype, chunk.cfg.max_position_embeddings)
    if use_apex_norms(chunk.rng.device):          # torch's norms compile into the layer; apex's would break it
        for layer in chunk.layers.values():
            for name in ("input_layernorm", "post_attention_layernorm"):
                fused = getattr(layer, name)
                plain = chunk.ctx.norm(fused=False)
                plain.weight = fused.weight
                if getattr(fused, "bias", None) is not None:
                    plain.bias = fused.bias
                setattr(layer, name, plain)
    return [layer.attention if layer.mlp_is_moe else layer for layer in chunk.layers.values()]


def _format_of(cfg: GPTConfig):
    """The HF format a GPT-family model exports to: Llama's with rotary embeddings, else GPT-2's."""
    return hf_llama if cfg.position_embedding_type == "rope" else hf_gpt2


def _config_from_hf(hf: dict, seq_length: int | None = None) -> GPTConfig:
    fmt = hf_llama if hf.get("model_type", "gpt2") in hf_llama.MODEL_TYPES else hf_gpt2
    return fmt.model_config_from_hf(hf, seq_length)


def _to_hf_state(tensors: dict, cfg: GPTConfig) -> dict:
    """Our whole tensors -> the format's state dict; HF norms hold the scale (stored + 1 under
    ``--apply-layernorm-1p``)."""
    return _format_of(cfg).to_hf_state(norm_scales_from_stored(tensors, cfg), cfg)


def _from_hf_state(state: dict, cfg: GPTConfig) -> dict:
    """The format's state dict -> our whole tensors; zero-centred norms (``--apply-layernorm-1p``) store scale - 1."""
    return norm_scales_from_stored(_format_of(cfg).from_hf_state(state, cfg), cfg, sign=-1)


HF = HFAdapter(model_types=("gpt2",) + hf_llama.MODEL_TYPES, config_from_hf=_config_from_hf,
               hf_config=lambda cfg: _format_of(cfg).hf_config(cfg), to_hf_state=_to_hf_state,
               from_hf_state=_from_hf_state)

GPT_SPEC = register_model_spec(ModelSpec(
    name="gpt", config=GPTConfig, build_chunk=build_chunk, boundary_shape=boundary_shape, loss=masked_mean,
    flops_per_token=flops_per_token, checkpoint_fields=CHECKPOINT_FIELDS, describe=describe,
    hooks=StepHooks(before_step=start_moe_step, after_step=after_moe_step, metrics=moe_metrics,
                    describe_metrics=describe_moe_metrics),
    hf=HF, activation_bytes=GPTActivations(), compile_regions=compile_regions, recomputed_share=recomputed_share,
    context_parallel=True, is_expert=is_expert_parameter, fp8_layers=lambda chunk, head: chunk.fp8_layers(head)))


def build_model_chunks(model_cfg: GPTConfig, parallel_cfg: ParallelConfig, topo, seed: int = 1234,
                       dtype: torch.dtype = torch.float32, device=None, fp8: FP8Config | None = None) -> list[GPT]:
    """The ``v`` GPT chunks this rank runs (``v = parallel_cfg.virtual_stages``, 1 unless interleaved),
    built for the placements of :func:`megazero.parallel.pipeline.partition.placements`: the GPT spec's
    :func:`megazero.spec.build_model_chunks` with the configs given apart (tests and benchmarks).

    Each chunk holds only its layers; parameter names are the full model's (``layers.5.mlp...``), so
    checkpoints and comparisons do not depend on the layout. ``parallel_cfg`` should have been through
    :func:`megazero.config.validate` (it derives ``virtual_stages``). ``device="meta"`` allocates
    nothing (the ZeRO engine then materialises each parameter where it lives). ``fp8``: the FP8 section
    (validated), under which the declared linears run in FP8.
    """
    job = JobConfig(model=model_cfg, parallel=parallel_cfg, train=TrainConfig(seed=seed), fp8=fp8 or FP8Config())
    return build_spec_chunks(GPT_SPEC, job, topo, dtype=dtype, device=device)
