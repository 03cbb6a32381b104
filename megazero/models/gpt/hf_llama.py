"""The HuggingFace Llama-family formats: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (the QKV bias) and, for
Mixture of Experts, ``MixtralForCausalLM`` (also read: ``MistralForCausalLM`` without a sliding window). Config and key map, both
directions, refusing what the other side cannot express (files and dispatch: :mod:`megazero.checkpoint.hf`).

Key map (``i`` = layer; every weight is nn.Linear-shaped [out, in] on both sides)::

    embedding.word_embeddings.weight       [V, h]         model.embed_tokens.weight
    layers.i.input_layernorm.weight                       model.layers.i.input_layernorm.weight
    layers.i.attention.query.{weight,bias} [n*d, h]       model.layers.i.self_attn.q_proj.*        (as is)
    layers.i.attention.key_value.*         [2G*d, h]      model.layers.i.self_attn.{k,v}_proj.*
        ours: per group [k_g; v_g] rows                    kv_interleaved_to_blocks / kv_blocks_to_interleaved
    layers.i.attention.qkv.*  (no GQA)     [3h, h]        q_proj, k_proj, v_proj
        ours: per head [q_j; k_j; v_j] rows                qkv_interleaved_to_blocks of cat([q; k; v])
    layers.i.attention.dense.*             [h, n*d]       model.layers.i.self_attn.o_proj.*
    layers.i.post_attention_layernorm.weight              model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.dense_h_to_4h.*           [2f, h]        model.layers.i.mlp.{gate,up}_proj.*
        ours: rows interleaved g0 u0 g1 u1 ...             interleaved_to_gate_up / gate_up_to_interleaved
    layers.i.mlp.dense_4h_to_h.*           [h, f]         model.layers.i.mlp.down_proj.*
    final_norm.weight                                     model.norm.weight
    output_layer.weight (untied only)      [V, h]         lm_head.weight

Mixture of Experts (``--num-experts``) is Mixtral's layout (written as published Mixtral checkpoints are;
transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` [E, 2f, h] / [E, h, f] also read)::

    layers.i.mlp.router.weight             [E, h]         model.layers.i.block_sparse_moe.gate.weight
    layers.i.mlp.experts.e.fc1.weight      [2f, h]        ...block_sparse_moe.experts.e.{w1 (gate), w3 (up)}.weight
        rows interleaved g0 u0 g1 u1 ...                   interleaved_to_gate_up / gate_up_to_interleaved
    layers.i.mlp.experts.e.fc2.weight      [h, f]         ...block_sparse_moe.experts.e.w2.weight

Mixtral routes as megazero does for top-k > 1 (softmax in fp32, top-k, gates renormalised); it has no
biases, every layer is MoE and it never drops tokens, so ``--moe-layer-freq`` > 1, ``--moe-router-topk
1`` and biases are refused, and a model trained with ``--moe-expert-capacity-factor`` runs dropless there.

RoPE is the "rotate half" pairing on both sides (no q/k permutation); ``--rotary-base`` is
``rope_theta``, ``--use-rope-scaling --rope-scaling-factor F`` is ``rope_scaling`` of type ``llama3``
with Llama 3.1's constants. Biases: ``--disable-bias-linear`` is ``attention_bias = mlp_bias = false``,
biases everywhere ``true``; ``--add-qkv-bias`` alone is Qwen2.
"""
from __future__ import annotations

import torch

from megazero.config import FLAG
from megazero.errors import CheckpointError
from megazero.models.gpt.config import GPTConfig
from megazero.models.gpt.rotary import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
)
from megazero.models.gpt.transformer import (
    gate_up_to_interleaved,
    interleaved_to_gate_up,
    kv_blocks_to_interleaved,
    kv_interleaved_to_blocks,
    qkv_blocks_to_interleaved,
    qkv_interleaved_to_blocks,
)

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
_PLAIN = {"input_layernorm.weight": "input_layernorm.weight",
          "post_attention_layernorm.weight": "post_attention_layernorm.weight",
          "attention.dense.weight": "self_attn.o_proj.weight", "attention.dense.bias": "self_attn.o_proj.bias",
          "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight", "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias"}
_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}
_IGNORED = (".rotary_emb.inv_freq",)        # a buffer older HF files saved


def _refuse(why: str):
    raise CheckpointError(f"cannot export to a HF Llama-family model: {why}")


def hf_config(cfg: GPTConfig) -> dict:
    """LlamaConfig (Qwen2Config with --add-qkv-bias alone) fields for a megazero model."""
    unlike = [what for what, differs in (
        (f"{FLAG.position_embedding_type} learned_absolute", cfg.position_embedding_type != "rope"),
        (f"{FLAG.normalization} LayerNorm", cfg.normalization != "RMSNorm"),
        (f"an MLP without {FLAG.swiglu}", not cfg.swiglu),
        (f"{FLAG.rotary_percent} {cfg.rotary_percent}", cfg.rotary_percent != 1.0)) if differs]
    if unlike:
        _refuse(f"{', '.join(unlike)} has no Llama equivalent")
    if cfg.num_experts:
        return _mixtral_config(cfg)
    qwen2 = cfg.add_qkv_bias and not cfg.add_bias_linear
    out = {"architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
           "model_type": "qwen2" if qwen2 else "llama", **_decoder_fields(cfg)}
    if qwen2:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    else:
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear, pretraining_tp=1)
    return out


def _mixtral_config(cfg: GPTConfig) -> dict:
    """MixtralConfig fields of an MoE model; refuses what Mixtral cannot express (see the module docstring)."""
    unlike = [what for what, differs in (
        (f"{FLAG.moe_layer_freq} {cfg.moe_layer_freq} (Mixtral's every layer is MoE)", cfg.moe_layer_freq != 1),
        (f"{FLAG.moe_router_topk} 1 (Mixtral renormalises the top-k gates, so its top-1 gate is always 1; megazero's "
         "keeps the softmax probability)", cfg.moe_router_topk == 1),
        (f"biases (drop {FLAG.add_qkv_bias}; use {FLAG.add_bias_linear})", cfg.add_bias_linear or cfg.add_qkv_bias),
        (f"{FLAG.moe_router_score_function} sigmoid", cfg.moe_router_score_function != "softmax"),
        (f"{FLAG.moe_router_num_groups}", cfg.moe_router_num_groups is not None),
        (f"{FLAG.moe_router_enable_expert_bias}", cfg.moe_router_enable_expert_bias),
        (f"{FLAG.moe_router_topk_scaling_factor}", cfg.moe_router_topk_scaling_factor is not None),
        (f"{FLAG.moe_shared_expert_intermediate_size}", cfg.moe_shared_expert_intermediate_size is not None),
        (f"{FLAG.moe_ffn_hidden_size} other than {FLAG.ffn_hidden_size}",
         cfg.expert_ffn_hidden_size != cfg.ffn_hidden_size))
        if differs]
    if unlike:
        _refuse(f"an MoE model exports as MixtralForCausalLM, which has no {', '.join(unlike)}")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **_decoder_fields(cfg),
            "sliding_window": None, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "router_jitter_noise": 0.0, "output_router_logits": False}


def _decoder_fields(cfg: GPTConfig) -> dict:
    """The fields Llama, Qwen2 and Mixtral configs share: sizes, attention, RoPE, norm, init."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
            "rope_theta": cfg.rotary_base, "rope_scaling": _rope_scaling(cfg),
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "use_cache": True, "torch_dtype": "float32"}


def _rope_scaling(cfg: GPTConfig) -> dict | None:
    if not cfg.use_rope_scaling:
        return None
    return {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> GPTConfig:
    """The megazero GPTConfig of a Llama / Mistral / Qwen2 config dict; refuses what is not implemented."""
    def refuse(why: str):
        raise CheckpointError(f"cannot import this HF model: {why}")

    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        refuse(f"model_type {kind!r} is not one of {', '.join(MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {hf.get('hidden_act')!r} (megazero's SwiGLU uses silu)")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    if hf.get("head_dim") not in (None, h // heads):
        refuse(f"head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads = {h // heads}")
    window = hf.get("sliding_window") if kind in ("mistral", "mixtral") or hf.get("use_sliding_window") else None
    if window is not None and window < hf.get("max_position_embeddings", 0):
        refuse(f"sliding_window {window} (megazero attends over the whole sequence)")
    bias, qkv_bias = _biases(hf, kind, refuse)
    theta, scaling = _rope(hf, refuse)
    experts, topk = (hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)) if kind == "mixtral" else (None, 2)
    if experts and topk == 1:
        refuse("num_experts_per_tok 1 (Mixtral's top-1 gate is always 1; megazero's keeps the softmax probability)")
    if experts and hf.get("router_jitter_noise"):
        refuse(f"router_jitter_noise {hf['router_jitter_noise']} (megazero's router has no input jitter)")
    n_pos = hf.get("max_position_embeddings", 2048)
    return GPTConfig(num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
                       ffn_hidden_size=hf["intermediate_size"], seq_length=seq_length or n_pos,
                       max_position_embeddings=n_pos, vocab_size=hf["vocab_size"],
                       untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                       attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0), hidden_dropout=0.0,
                       init_method_std=hf.get("initializer_range", 0.02),
                       layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
                       rotary_base=theta, use_rope_scaling=scaling is not None, rope_scaling_factor=scaling or 8.0,
                       normalization="RMSNorm", swiglu=True, group_query_attention=kv != heads,
                       num_query_groups=kv if kv != heads else None, add_bias_linear=bias, add_qkv_bias=qkv_bias,
                       num_experts=experts, moe_router_topk=topk,
                       moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)) if experts else 0.0)


def _biases(hf: dict, kind: str, refuse) -> tuple[bool, bool]:
    """(add_bias_linear, add_qkv_bias) of a config."""
    if kind == "qwen2":
        return False, True
    attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention != mlp:
        refuse(f"attention_bias={attention} with mlp_bias={mlp} (megazero has biases everywhere or nowhere, "
               f"or in QKV only)")
    return attention, False


def _rope(hf: dict, refuse) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from ``rope_parameters`` or the older ``rope_theta`` +
    ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        refuse("partial_rotary_factor != 1")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    expected = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}
    if kind != "llama3" or any(float(params.get(k, v)) != v for k, v in expected.items()):
        refuse(f"rope scaling {params} (megazero implements llama3 scaling with {expected})")
    return theta, float(params["factor"])


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """megazero whole tensors -> LlamaForCausalLM state dict (tied: no lm_head.weight, as HF saves it)."""
    out = {}
    for name, t in tensors.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        _, layer, rest = name.split(".", 2) if name.startswith("layers.") else ("", "", name)
        prefix, kind = f"model.layers.{layer}.", rest.rpartition(".")[2]
        if rest in _PLAIN:
            out[prefix + _PLAIN[rest]] = t
        elif rest.startswith("attention.query."):
            out[f"{prefix}self_attn.q_proj.{kind}"] = t
        elif rest.startswith("attention.key_value."):
            k, v = kv_interleaved_to_blocks(t, cfg.kv_heads)
            out.update({f"{prefix}self_attn.k_proj.{kind}": k, f"{prefix}self_attn.v_proj.{kind}": v})
        elif rest.startswith("attention.qkv."):
            for proj, part in zip("qkv", qkv_interleaved_to_blocks(t, cfg.num_attention_heads).chunk(3)):
                out[f"{prefix}self_attn.{proj}_proj.{kind}"] = part
        elif rest.startswith("mlp.dense_h_to_4h."):
            gate, up = interleaved_to_gate_up(t)
            out.update({f"{prefix}mlp.gate_proj.{kind}": gate, f"{prefix}mlp.up_proj.{kind}": up})
        elif rest == "mlp.router.weight":
            out[f"{prefix}block_sparse_moe.gate.weight"] = t
        elif rest.startswith("mlp.experts.") and rest.endswith((".fc1.weight", ".fc2.weight")):
            expert = f"{prefix}block_sparse_moe.experts.{rest.split('.')[2]}."
            if rest.endswith(".fc2.weight"):
                out[expert + "w2.weight"] = t
            else:
                gate, up = interleaved_to_gate_up(t)
                out.update({expert + "w1.weight": gate, expert + "w3.weight": up})
        else:
            raise CheckpointError(f"megazero tensor {name!r} has no Llama equivalent: cannot export to HF")
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM (Mistral, Qwen2) state dict -> megazero whole tensors; every key must be used."""
    state = {k: v.float() for k, v in state.items() if not k.endswith(_IGNORED)}
    out = {}
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in state:
        if not torch.equal(state.pop("lm_head.weight"), state["model.embed_tokens.weight"]):
            raise CheckpointError("lm_head.weight differs from model.embed_tokens.weight but the config ties "
                                  "them (tie_word_embeddings): the HF checkpoint is inconsistent")
    for ours, theirs in _GLOBAL.items():
        if theirs in state:
            out[ours] = state.pop(theirs)
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in _PLAIN.items():
            if prefix + theirs in state:
                out[f"layers.{i}.{ours}"] = state.pop(prefix + theirs)
        for kind in ("weight", "bias"):
            q, k, v = (state.pop(f"{prefix}self_attn.{p}_proj.{kind}", None) for p in "qkv")
            gate, up = (state.pop(f"{prefix}mlp.{p}_proj.{kind}", None) for p in ("gate", "up"))
            if (k is None) != (v is None) or (gate is None) != (up is None):
                raise CheckpointError(f"layer {i}: k_proj/v_proj or gate_proj/up_proj {kind} come without "
                                      f"their partner: the HF checkpoint is incomplete")
            if k is not None and cfg.group_query_attention:
                out[f"layers.{i}.attention.key_value.{kind}"] = kv_blocks_to_interleaved(k, v, cfg.kv_heads)
            elif k is not None and q is not None:                       # multi-head: one fused qkv
                out[f"layers.{i}.attention.qkv.{kind}"] = qkv_blocks_to_interleaved(torch.cat([q, k, v]),
                                                                                     cfg.num_attention_heads)
                q = None
            elif k is not None:
                raise CheckpointError(f"layer {i}: k_proj/v_proj.{kind} without q_proj.{kind}")
            if q is not None:
                out[f"layers.{i}.attention.query.{kind}"] = q
            if gate is not None:
                out[f"layers.{i}.mlp.dense_h_to_4h.{kind}"] = gate_up_to_interleaved(gate, up)
        if cfg.num_experts:
            out.update(_experts_from_hf(state, i, cfg.num_experts))
    if state:
        raise CheckpointError(f"HF tensors {sorted(state)[:5]} have no megazero equivalent: refusing to drop them")
    return {k: v.contiguous() for k, v in out.items()}


def _experts_from_hf(state: dict[str, torch.Tensor], i: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts, popped from a Mixtral state dict: the published per-expert
    w1/w2/w3 layout or transformers 5's fused gate_up_proj/down_proj."""
    legacy, fused = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
    prefix = legacy if legacy + "gate.weight" in state else fused
    out = {f"layers.{i}.mlp.router.weight": state.pop(prefix + "gate.weight")}
    if prefix == fused:
        gate_up, down = state.pop(fused + "experts.gate_up_proj"), state.pop(fused + "experts.down_proj")
    for e in range(num_experts):
        if prefix == legacy:
            w1, w3, w2 = (state.pop(f"{legacy}experts.{e}.{w}.weight") for w in ("w1", "w3", "w2"))
        else:
            (w1, w3), w2 = gate_up[e].chunk(2), down[e]
        out[f"layers.{i}.mlp.experts.{e}.fc1.weight"] = gate_up_to_interleaved(w1, w3)
        out[f"layers.{i}.mlp.experts.{e}.fc2.weight"] = w2
    return out
