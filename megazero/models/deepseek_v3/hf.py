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

Mixture of Experts (DeepSeek routing: ``--moe-router-score-function sigmoid``, group-limited top-k, expert bias,
scaling factor; the dense layers first, ``first_k_dense_replace``), written as DeepSeek's checkpoints and
``save_pretrained`` write them (per expert)::

    layers.i.mlp.router.weight [E, h]              model.layers.i.mlp.gate.weight
    layers.i.mlp.router.expert_bias [E] (buffer)   model.layers.i.mlp.gate.e_score_correction_bias
    layers.i.mlp.experts.e.fc1.weight [2f, h]      ...mlp.experts.e.{gate,up}_proj.weight (rows interleaved)
    layers.i.mlp.experts.e.fc2.weight              ...mlp.experts.e.down_proj.weight
    layers.i.mlp.shared_experts.fc1/fc2.weight     ...mlp.shared_experts.{gate,up,down}_proj.weight

Multi-token prediction (``--mtp-num-layers D``; HF's model has none, DeepSeek's checkpoints hold them after the
decoder, ``num_nextn_predict_layers`` D): module k-1 is ``model.layers.<L + k - 1>.``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` (our ``final_norm``), the decoder layer's keys as above, and copies of the
embedding (``embed_tokens``) and head (``shared_head.head``) written on export, checked equal on import.
"""
from __future__ import annotations

import re

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
        ("zero-centred norm weights", cfg.apply_layernorm_1p)) if differs]
    if unlike:
        _refuse("export to", f"{', '.join(unlike)} not written by this adapter")
    moe = _moe_config(cfg) if cfg.num_experts else {"first_k_dense_replace": cfg.num_layers}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
            "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
            **moe, "num_nextn_predict_layers": cfg.mtp_depth,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.layernorm_epsilon, "rope_parameters": _rope_parameters(cfg),
            "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": False,
            "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "use_cache": True, "torch_dtype": "float32"}


def _rope_parameters(cfg: DeepSeekV3Config) -> dict:
    """HF's ``rope_parameters``: plain RoPE, or YaRN's with our ``--rope-type yarn`` flags."""
    if cfg.rope_type != "yarn":
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rotary_scaling_factor,
            "original_max_position_embeddings": cfg.original_max_position_embeddings,
            "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow, "mscale": cfg.mscale,
            "mscale_all_dim": cfg.mscale_all_dim}


def _rope_from_hf(params: dict, n_pos: int) -> dict:
    """Our RoPE flags of HF's ``rope_parameters`` / ``rope_scaling`` (plain or YaRN; others refused)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {}
    unsupported = [k for k in ("attention_factor", "truncate") if k in params and params[k] not in (None, True)]
    if kind != "yarn" or unsupported:
        _refuse("import", f"rope scaling {params} (plain RoPE and YaRN without attention_factor/truncate only)")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor") or (n_pos / original if original else None)
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor or 1.0),
                original_max_position_embeddings=int(original or n_pos),
                beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))


def _dense_first(cfg: DeepSeekV3Config) -> int | None:
    """How many dense layers come first when every later layer is MoE (None: another pattern)."""
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    k = moe.index(True) if True in moe else cfg.num_layers
    return k if all(moe[k:]) else None


def _moe_config(cfg: DeepSeekV3Config) -> dict:
    """The routing fields of an MoE model; refuses what DeepseekV3's router and layers cannot express."""
    f, shared = cfg.expert_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size or 0
    unlike = [what for what, differs in (
        (f"{FLAG.moe_router_score_function} {cfg.moe_router_score_function} (HF's is sigmoid)",
         cfg.moe_router_score_function != "sigmoid"),
        (f"{FLAG.moe_layer_freq} {cfg.moe_layer_freq} (HF: dense layers first, then every layer MoE)",
         _dense_first(cfg) is None),
        (f"{FLAG.moe_shared_expert_intermediate_size} {shared} (HF: a positive multiple of the expert width {f})",
         not shared or shared % f),
        (f"{FLAG.moe_router_topk} 1 (HF renormalises a lone gate to 1)", cfg.moe_router_topk == 1)) if differs]
    if unlike:
        _refuse("export to", ", ".join(unlike))
    return {"first_k_dense_replace": _dense_first(cfg), "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk, "moe_intermediate_size": f, "n_shared_experts": shared // f,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0, "norm_topk_prob": True,
            "n_group": cfg.moe_router_num_groups or 1, "topk_group": cfg.moe_router_group_topk or 1}


def _moe_from_hf(hf: dict, layers: int) -> dict:
    """Our MoE fields of a DeepseekV3Config dict (none when every layer is dense)."""
    dense = min(hf.get("first_k_dense_replace", 3), layers)
    if dense == layers:
        return {}
    if not hf.get("norm_topk_prob", True) or hf.get("num_experts_per_tok", 8) == 1:
        _refuse("import", "norm_topk_prob false or num_experts_per_tok 1 (megazero renormalises top-k > 1 gates)")
    f, groups = hf["moe_intermediate_size"], hf.get("n_group") or 1
    return dict(num_experts=hf["n_routed_experts"], moe_router_topk=hf["num_experts_per_tok"],
                moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_ffn_hidden_size=f,
                moe_shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * f or None,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf.get("topk_group") if groups > 1 else None)


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> DeepSeekV3Config:
    """The megazero config of a DeepseekV3Config dict; refuses what is not implemented."""
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    checks = (
        (f"hidden_act {hf.get('hidden_act')!r} (megazero's SwiGLU uses silu)", hf.get("hidden_act", "silu") != "silu"),
        (f"num_key_value_heads {hf.get('num_key_value_heads')} != num_attention_heads {heads}",
         hf.get("num_key_value_heads") not in (None, heads)),
        ("attention_bias true", bool(hf.get("attention_bias", False))),
        ("tied word embeddings", bool(hf.get("tie_word_embeddings", False))))
    refused = [what for what, bad in checks if bad]
    if refused:
        _refuse("import", ", ".join(refused))
    n_pos = hf.get("max_position_embeddings", 4096)
    rope = _rope_from_hf(params, n_pos)
    return DeepSeekV3Config(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], seq_length=seq_length or n_pos, max_position_embeddings=n_pos,
        vocab_size=hf["vocab_size"], attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=hf.get("initializer_range", 0.02), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rotary_base=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        mtp_num_layers=hf.get("num_nextn_predict_layers") or None, **_moe_from_hf(hf, layers), **rope)


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


_GATE_UP = re.compile(r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up)_proj\.weight")
_DOWN = re.compile(r"mlp\.(experts\.\d+\.|shared_experts\.)down_proj\.weight")
_ROUTER = {"mlp.router.weight": "mlp.gate.weight", "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "final_norm.weight": "shared_head.norm.weight"}


def _layer_to_hf(rest: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's tensor (its name after ``layers.<i>.``) -> its HF tensors (names after ``model.layers.<i>.``)."""
    if rest in _PLAIN:
        return {_PLAIN[rest]: t}
    if rest in _ROUTER:
        return {_ROUTER[rest]: t}
    if rest == "mlp.dense_h_to_4h.weight" or (rest.startswith("mlp.") and rest.endswith(".fc1.weight")):
        prefix = rest[len("mlp."):-len("fc1.weight")] if rest.endswith(".fc1.weight") else ""
        gate, up = interleaved_to_gate_up(t)
        return {f"mlp.{prefix}gate_proj.weight": gate, f"mlp.{prefix}up_proj.weight": up}
    if rest.startswith("mlp.") and rest.endswith(".fc2.weight"):
        return {f"mlp.{rest[len('mlp.'):-len('fc2.weight')]}down_proj.weight": t}
    raise CheckpointError(f"cannot export tensor {rest!r} to DeepseekV3ForCausalLM: no HF key for it")


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: DeepSeekV3Config) -> dict[str, torch.Tensor]:
    """megazero whole tensors -> DeepseekV3ForCausalLM state dict (MTP modules after the decoder, with
    copies of the embedding and head; a zero expert bias where the model routes without one)."""
    out = {}
    for name, t in _reorder_rope(tensors, cfg, to_interleaved=True).items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        kind, index, rest = name.split(".", 2)
        if kind == "mtp":
            prefix = f"model.layers.{cfg.num_layers + int(index)}."
            if rest in _MTP_OWN:
                out[prefix + _MTP_OWN[rest]] = t
                continue
            rest = rest.removeprefix("layer.")
        else:
            prefix = f"model.layers.{index}."
        out.update({prefix + k: v for k, v in _layer_to_hf(rest, t).items()})
    for i in [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]:
        key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if key not in out and cfg.moe_router_enable_expert_bias:
            raise CheckpointError(f"layers.{i}.mlp.router.expert_bias is not among the tensors to export (a "
                                  f"buffer, which this source does not hold): export from the model itself")
        out.setdefault(key, torch.zeros(cfg.num_experts))          # routing without a bias: HF's zero bias
    for k in range(cfg.mtp_depth):
        prefix = f"model.layers.{cfg.num_layers + k}."
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[prefix + "shared_head.head.weight"] = out["lm_head.weight"].clone()
    return out


def _layer_from_hf(rest: str) -> tuple[str, str | None] | None:
    """An HF layer key (after ``model.layers.<i>.``) -> (our name after ``layers.<i>.``, "gate" / "up" for
    half of a gate/up pair, else None); None for a key of no parameter of ours."""
    if rest in _LAYER_KEYS:
        return _LAYER_KEYS[rest], None
    if rest in _ROUTER_KEYS:
        return _ROUTER_KEYS[rest], None
    if match := _GATE_UP.fullmatch(rest):
        prefix = match.group(1) or ""
        return (f"mlp.{prefix}fc1.weight" if prefix else "mlp.dense_h_to_4h.weight"), match.group(2)
    if match := _DOWN.fullmatch(rest):
        return f"mlp.{match.group(1)}fc2.weight", None
    return None


_LAYER_KEYS = {v: k for k, v in _PLAIN.items()}
_ROUTER_KEYS = {v: k for k, v in _ROUTER.items()}
_MTP_KEYS = {v: k for k, v in _MTP_OWN.items()}


def from_hf_state(state: dict[str, torch.Tensor], cfg: DeepSeekV3Config) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM state dict (and DeepSeek's MTP layers after the decoder) -> megazero whole
    tensors; an unknown key, half a gate/up pair or an MTP copy of the embedding or head that differs from
    the model's is an error."""
    globals_ = {v: k for k, v in _GLOBAL.items()}
    out, halves, copies = {}, {}, {}
    for key, t in state.items():
        if key in globals_:
            out[globals_[key]] = t
            continue
        parts = key.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise CheckpointError(f"cannot import HF tensor {key!r}: no megazero parameter for it")
        i, rest = int(parts[2]), parts[3]
        ours = f"layers.{i}."
        if i >= cfg.num_layers:
            ours = f"mtp.{i - cfg.num_layers}."
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                copies[key] = ("model.embed_tokens.weight" if rest.startswith("embed") else "lm_head.weight", t)
                continue
            if rest in _MTP_KEYS:
                out[ours + _MTP_KEYS[rest]] = t
                continue
            ours += "layer."
        found = _layer_from_hf(rest)
        if found is None or i >= cfg.num_layers + cfg.mtp_depth:
            raise CheckpointError(f"cannot import HF tensor {key!r}: no megazero parameter for it")
        name, half = found
        if half is None:
            out[ours + name] = t
        else:
            halves.setdefault(ours + name, {})[half] = t
    for name, pair in halves.items():
        if set(pair) != {"gate", "up"}:
            raise CheckpointError(f"{name}: HF holds only the {sorted(pair)} half of its gate/up projections")
        out[name] = gate_up_to_interleaved(pair["gate"], pair["up"])
    for key, (original, t) in copies.items():
        if original in state and not torch.equal(state[original], t):
            raise CheckpointError(f"HF tensor {key!r} differs from {original!r}: megazero's MTP modules share the "
                                  f"model's embedding and head")
    return _reorder_rope(out, cfg, to_interleaved=False)
