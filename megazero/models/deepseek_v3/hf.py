"""HuggingFace's ``DeepseekV3ForCausalLM`` format (``model_type`` deepseek_v3): config and key map, both
directions, refusing what the other side cannot express (files and dispatch: :mod:`megazero.checkpoint.hf`).

Key map (``i`` = layer; every weight nn.Linear-shaped [out, in] on both sides, no biases)::

    embedding.word_embeddings.weight           model.embed_tokens.weight
    layers.i.input_layernorm.weight            model.layers.i.input_layernorm.weight
    layers.i.attention.<p>.weight              model.layers.i.self_attn.<p>.weight   for <p> in q_a_proj,
                                               q_a_layernorm, q_b_proj, q_proj, kv_a_proj_with_mqa,
                                               kv_a_layernorm, kv_b_proj
        the RoPE rows of q_b_proj / q_proj (each head's last D_r) and of kv_a_proj_with_mqa (its last D_r):
        ours pair feature j with j + D_r/2 ("rotate half"), HF's with rope_interleave (written true, as
        DeepSeek's checkpoints) 2j with 2j+1: reordered evens-then-odds on import, back on export
    layers.i.attention.dense.weight            model.layers.i.self_attn.o_proj.weight
    layers.i.post_attention_layernorm.weight   model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.dense_h_to_4h.weight [2f, h]  model.layers.i.mlp.{gate,up}_proj.weight (rows interleaved g0 u0 ...)
    layers.i.mlp.dense_4h_to_h.weight          model.layers.i.mlp.down_proj.weight
    final_norm.weight                          model.norm.weight
    output_layer.weight                        lm_head.weight
"""
from __future__ import annotations

import torch

from megazero.config import FLAG
from megazero.errors import CheckpointError
from megazero.models.deepseek_v3.config import DeepSeekV3Config
from megazero.models.gpt.transformer import gate_up_to_interleaved, interleaved_to_gate_up

MODEL_TYPES = ("deepseek_v3",)
_ATTENTION = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
_PLAIN = {"input_layernorm.weight": "input_layernorm.weight",
          "post_attention_layernorm.weight": "post_attention_layernorm.weight",
          "attention.dense.weight": "self_attn.o_proj.weight", "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
          **{f"attention.{p}.weight": f"self_attn.{p}.weight" for p in _ATTENTION}}
_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}


def _refuse(direction: str, why: str):
    raise CheckpointError(f"cannot {direction} a HF DeepseekV3ForCausalLM: {why}")


def hf_config(cfg: DeepSeekV3Config) -> dict:
    """DeepseekV3Config fields for a megazero model; refuses what the format cannot express."""
    unlike = [what for what, differs in (
        (f"an MLP without {FLAG.swiglu}", not cfg.swiglu), ("LayerNorm", cfg.normalization != "RMSNorm"),
        ("biases", cfg.add_bias_linear or cfg.add_qkv_bias), ("tied embeddings",
                                                              not cfg.untie_embeddings_and_output_weights),
        ("zero-centred norm weights", cfg.apply_layernorm_1p), ("Mixture-of-Experts layers", bool(cfg.num_experts)),
        ("multi-token prediction modules", bool(cfg.mtp_depth))) if differs]
    if unlike:
        _refuse("export to", f"{', '.join(unlike)} not written by this adapter")
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
            "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
            "first_k_dense_replace": cfg.num_layers, "num_nextn_predict_layers": cfg.mtp_depth,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.layernorm_epsilon, "rope_parameters": {"rope_type": "default",
                                                                       "rope_theta": cfg.rotary_base},
            "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": False,
            "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "use_cache": True, "torch_dtype": "float32"}


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> DeepSeekV3Config:
    """The megazero config of a DeepseekV3Config dict; refuses what is not implemented."""
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    checks = (
        (f"hidden_act {hf.get('hidden_act')!r} (megazero's SwiGLU uses silu)", hf.get("hidden_act", "silu") != "silu"),
        (f"num_key_value_heads {hf.get('num_key_value_heads')} != num_attention_heads {heads}",
         hf.get("num_key_value_heads") not in (None, heads)),
        ("attention_bias true", bool(hf.get("attention_bias", False))),
        ("tied word embeddings", bool(hf.get("tie_word_embeddings", False))),
        (f"rope scaling {params} (plain RoPE only)", params.get("rope_type", params.get("type", "default")) != "default"),
        (f"Mixture-of-Experts layers (first_k_dense_replace {hf.get('first_k_dense_replace')} < {layers} layers)",
         hf.get("first_k_dense_replace", 3) < layers))
    refused = [what for what, bad in checks if bad]
    if refused:
        _refuse("import", ", ".join(refused))
    n_pos = hf.get("max_position_embeddings", 4096)
    return DeepSeekV3Config(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], seq_length=seq_length or n_pos, max_position_embeddings=n_pos,
        vocab_size=hf["vocab_size"], attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=hf.get("initializer_range", 0.02), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rotary_base=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"])


def _rope_rows(w: torch.Tensor, rope: int, heads: int, to_interleaved: bool) -> torch.Tensor:
    """``w`` with the last ``rope`` rows of each of its ``heads`` row blocks reordered: interleaved pairs
    (2j, 2j+1) -> evens then odds (``to_interleaved=False``), or back."""
    blocks = w.reshape(heads, -1, *w.shape[1:]).clone()
    part = blocks[:, -rope:]
    if to_interleaved:
        part = torch.stack((part[:, :rope // 2], part[:, rope // 2:]), 2).reshape(part.shape)
    else:
        part = torch.cat((part[:, 0::2], part[:, 1::2]), 1)
    blocks[:, -rope:] = part
    return blocks.reshape(w.shape)


def _reorder_rope(tensors: dict[str, torch.Tensor], cfg: DeepSeekV3Config, to_interleaved: bool) -> dict:
    """Every RoPE row block of the query and shared-key projections reordered (see the module docstring)."""
    out = dict(tensors)
    for name, t in tensors.items():
        if name.endswith(("attention.q_b_proj.weight", "attention.q_proj.weight")):
            out[name] = _rope_rows(t, cfg.qk_pos_emb_head_dim, cfg.num_attention_heads, to_interleaved)
        elif name.endswith("attention.kv_a_proj_with_mqa.weight"):
            out[name] = _rope_rows(t, cfg.qk_pos_emb_head_dim, 1, to_interleaved)
    return out


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: DeepSeekV3Config) -> dict[str, torch.Tensor]:
    """megazero whole tensors -> DeepseekV3ForCausalLM state dict."""
    out = {}
    for name, t in _reorder_rope(tensors, cfg, to_interleaved=True).items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        prefix = f"model.layers.{i}."
        if rest == "mlp.dense_h_to_4h.weight":
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = interleaved_to_gate_up(t)
        elif rest in _PLAIN:
            out[prefix + _PLAIN[rest]] = t
        else:
            raise CheckpointError(f"cannot export tensor {name!r} to DeepseekV3ForCausalLM: no HF key for it")
    return out


def from_hf_state(state: dict[str, torch.Tensor], cfg: DeepSeekV3Config) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM state dict -> megazero whole tensors; a missing or unknown key is an error."""
    ours = {v: k for k, v in _GLOBAL.items()}
    layer_keys = {v: k for k, v in _PLAIN.items()}
    out, gate_up = {}, {}
    for key, t in state.items():
        if key in ours:
            out[ours[key]] = t
            continue
        parts = key.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and int(parts[2]) < cfg.num_layers:
            i, rest = parts[2], parts[3]
            if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                gate_up.setdefault(i, {})[rest.split(".")[1]] = t
                continue
            if rest in layer_keys:
                out[f"layers.{i}.{layer_keys[rest]}"] = t
                continue
        raise CheckpointError(f"cannot import HF tensor {key!r}: no megazero parameter for it")
    for i, pair in gate_up.items():
        if set(pair) != {"gate_proj", "up_proj"}:
            raise CheckpointError(f"HF layer {i} has {sorted(pair)} of its MLP's gate_proj and up_proj: need both")
        out[f"layers.{i}.mlp.dense_h_to_4h.weight"] = gate_up_to_interleaved(pair["gate_proj"], pair["up_proj"])
    return _reorder_rope(out, cfg, to_interleaved=False)
