"""The DeepSeek-V3 family's model spec (``--model-family deepseek_v3``; :mod:`megazero.spec` lists what a
spec supplies).

    chunks      :class:`~megazero.models.deepseek_v3.model.DeepSeekV3`, one per pipeline placement
    boundary    GPT's: [s, b, h], or [s / tp, b, h] under sequence parallelism
    loss        the masked mean of the per-token losses, plus the MTP modules' (:func:`.model.mtp_loss`)
    FLOPs       :func:`flops_per_token` (6 x the matmul parameters a token meets, plus attention)
    hooks       GPT's MoE hooks (auxiliary losses' scale, expert-bias updates, routing figures), the MTP loss
    HF          ``DeepseekV3ForCausalLM`` (:mod:`.hf`)
    activations :class:`~megazero.models.deepseek_v3.memory.DeepSeekV3Activations` (GPT's count with latent
                attention's parts and the MTP modules)
    experts     the parameters of ``layers.<i>.mlp.experts.<e>``
    tiny        :data:`TINY_MODELS`: small latent-attention ranks, with and without one MTP module
    config      :class:`~megazero.models.deepseek_v3.config.DeepSeekV3Config`
"""
from __future__ import annotations

import dataclasses

import torch

from megazero.models.deepseek_v3 import hf
from megazero.models.deepseek_v3.config import FAMILY, DeepSeekV3Config
from megazero.models.deepseek_v3.memory import DeepSeekV3Activations
from megazero.models.deepseek_v3.model import DeepSeekV3, mtp_loss, mtp_metrics
from megazero.models.gpt.moe import is_expert_parameter
from megazero.models.gpt.spec import CHECKPOINT_FIELDS as GPT_CHECKPOINT_FIELDS
from megazero.models.gpt.spec import GPT_SPEC, boundary_shape
from megazero.spec import HFAdapter, ModelSpec, register_model_spec

CHECKPOINT_FIELDS = GPT_CHECKPOINT_FIELDS + ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                  "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
                                                  "rope_type", "rotary_scaling_factor",
                                                  "original_max_position_embeddings", "beta_fast", "beta_slow",
                                                  "mscale", "mscale_all_dim")

def _own_flag(name: str) -> str:
    """The command-line spelling of this family's config field ``name``, read from the class itself (at import
    the configuration's registry may not know the family yet)."""
    return {f.name: f for f in dataclasses.fields(DeepSeekV3Config)}[name].metadata["flag"].spellings[0]


# The family's tiny models (hidden 32, 4 heads: the layout fuzzer's shared sizes): latent ranks and head
# dimensions of 8-16 features, a narrow MLP; the "mtp" variant adds one multi-token prediction module.
TINY_FLAGS = tuple(part for name, value in (("ffn_hidden_size", 64), ("q_lora_rank", 16), ("kv_lora_rank", 16),
                                            ("qk_head_dim", 8), ("qk_pos_emb_head_dim", 8), ("v_head_dim", 8))
                   for part in (_own_flag(name), str(value)))
TINY_MODELS = (("", TINY_FLAGS), ("mtp", TINY_FLAGS + (_own_flag("mtp_num_layers"), "1")))


def build_chunk(model_cfg: DeepSeekV3Config, placement, groups, *, seed: int = 1234, dtype=None, device=None,
                home_device=None) -> DeepSeekV3:
    """One chunk: the placement's layers, the embedding on the first stage, the head on the last."""
    return DeepSeekV3(model_cfg, groups, layer_ids=placement.layer_ids, pre_process=placement.pre_process,
                      post_process=placement.post_process, seed=seed, dtype=dtype or torch.float32, device=device,
                      home_device=home_device)


def attention_matmul(cfg: DeepSeekV3Config) -> int:
    """Matmul parameters of one latent attention: the query path (bottleneck or plain), the key/value
    down- and up-projections, the output projection."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    query_width = n * cfg.query_head_dim
    query = h * query_width if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + query_width)
    key_value = h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) + cfg.kv_lora_rank * n * (cfg.qk_head_dim
                                                                                           + cfg.v_head_dim)
    return query + key_value + n * cfg.v_head_dim * h


def mlp_matmul(cfg: DeepSeekV3Config, layer: int) -> int:
    """Matmul parameters a token meets in layer ``layer``'s MLP (an MoE layer: its top-k experts, the shared
    experts and the router)."""
    h, per_width = cfg.hidden_size, (3 if cfg.swiglu else 2) * cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return per_width * cfg.ffn_hidden_size
    shared = cfg.moe_shared_expert_intermediate_size or 0
    return per_width * (cfg.moe_router_topk * cfg.expert_ffn_hidden_size + shared) + h * cfg.num_experts


def flops_per_token(cfg: DeepSeekV3Config, vocab: int, recompute: float = 0.0) -> float:
    """Training FLOPs per token, Megatron/PaLM's convention: (3 + recompute) x the layers' forward
    (2 x matmul parameters, plus the attention scores over s keys, 2 s n (D_nope + D_r), and values,
    2 s n D_v, counted in full) + 3 x the output layer's 2 h V; each MTP module adds 3 x its forward
    (eh_proj's 2h x h, a dense layer, the head's 2 h V; recompute does not rerun it)."""
    s, n = cfg.seq_length, cfg.num_attention_heads
    scores = 2 * s * n * (cfg.query_head_dim + cfg.v_head_dim)
    layers = sum(2 * (attention_matmul(cfg) + mlp_matmul(cfg, i)) + scores for i in range(cfg.num_layers))
    h, depth = cfg.hidden_size, cfg.mtp_depth       # each MTP module: eh_proj, its layer, the head again
    mtp = depth * (2 * (2 * h * h + attention_matmul(cfg) + mlp_matmul(cfg, cfg.num_layers)) + scores)
    return (3 + float(recompute)) * layers + 3 * (mtp + (1 + depth) * 2 * h * vocab)


def describe(m: DeepSeekV3Config) -> str:
    """The architecture in a few words, for the first log line."""
    query = f"q rank {m.q_lora_rank}" if m.q_lora_rank is not None else "plain q"
    parts = [f"MLA ({query}, kv rank {m.kv_lora_rank}, head dims {m.qk_head_dim}+{m.qk_pos_emb_head_dim}/"
             f"{m.v_head_dim})", f"SwiGLU (ffn {m.ffn_hidden_size})" if m.swiglu else "GELU"]
    if m.num_experts:
        parts.append(f"MoE ({m.num_experts} experts, top-{m.moe_router_topk})")
    if m.mtp_depth:
        parts.append(f"MTP ({m.mtp_depth} module(s), loss weight {m.mtp_loss_scaling_factor:g})")
    return ", " + ", ".join(parts)


def metrics(chunks, job, tp_rank: int, steps: int, device) -> dict:
    """GPT's MoE routing figures and the MTP loss (collectives, every rank calls them)."""
    return {**GPT_SPEC.hooks.metrics(chunks, job, tp_rank, steps, device),
            **mtp_metrics(chunks, job, tp_rank, steps, device)}


def describe_metrics(values: dict) -> str:
    """The log line's MoE part (GPT's), then `` | mtp loss 2.3456`` with MTP."""
    moe = GPT_SPEC.hooks.describe_metrics({k: v for k, v in values.items() if k != "mtp_loss"})
    return moe + (f" | mtp loss {values['mtp_loss']:.4f}" if "mtp_loss" in values else "")


HF = HFAdapter(model_types=hf.MODEL_TYPES, config_from_hf=hf.model_config_from_hf, hf_config=hf.hf_config,
               to_hf_state=hf.to_hf_state, from_hf_state=hf.from_hf_state)

DEEPSEEK_V3_SPEC = register_model_spec(ModelSpec(
    name=FAMILY, config=DeepSeekV3Config, build_chunk=build_chunk, boundary_shape=boundary_shape,
    loss=mtp_loss, flops_per_token=flops_per_token, checkpoint_fields=CHECKPOINT_FIELDS, describe=describe,
    hooks=dataclasses.replace(GPT_SPEC.hooks, metrics=metrics, describe_metrics=describe_metrics),
    hf=HF, activation_bytes=DeepSeekV3Activations(), context_parallel=True, is_expert=is_expert_parameter,
    tiny_models=TINY_MODELS))
