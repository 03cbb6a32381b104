"""The HuggingFace ``GPT2LMHeadModel`` format: its config and key map, in both directions, refusing what
the other side cannot express (files and dispatch: :mod:`megazero.checkpoint.hf`).

Key map (``i`` = layer; HF Conv1D weights are stored [in, out], ours nn.Linear [out, in])::

    embedding.word_embeddings.weight   [V, h]    transformer.wte.weight        [V, h]
    embedding.position_embeddings...   [P, h]    transformer.wpe.weight        [P, h]
    layers.i.input_layernorm.*                   transformer.h.i.ln_1.*
    layers.i.attention.qkv.weight      [3h, h]   transformer.h.i.attn.c_attn.weight  [h, 3h]
        ours: per head [q_j; k_j; v_j] rows      HF: columns [Q_all | K_all | V_all]
        (qkv_interleaved_to_blocks, then transpose; the bias likewise without the transpose)
    layers.i.attention.dense.weight    [h, h]    transformer.h.i.attn.c_proj.weight  (transposed)
    layers.i.post_attention_layernorm.*          transformer.h.i.ln_2.*
    layers.i.mlp.dense_h_to_4h.weight  [f, h]    transformer.h.i.mlp.c_fc.weight     [h, f]
    layers.i.mlp.dense_4h_to_h.weight  [h, f]    transformer.h.i.mlp.c_proj.weight   [f, h]
    final_norm.*                                 transformer.ln_f.*
    output_layer.weight (untied only)            lm_head.weight (tie_word_embeddings false)

GELU: megazero ``gelu_tanh`` is HF ``gelu_new`` (also accepted on import: ``gelu_pytorch_tanh``);
megazero ``gelu`` (exact erf) is HF ``gelu``.
"""
from __future__ import annotations

import torch

from megazero.config import FLAG
from megazero.errors import CheckpointError
from megazero.models.gpt.config import GPTConfig
from megazero.models.gpt.transformer import (
    qkv_blocks_to_interleaved,
    qkv_interleaved_to_blocks,
)

_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_LAYER_MAP = {  # ours -> (HF, transpose)
    "input_layernorm.weight": ("ln_1.weight", False), "input_layernorm.bias": ("ln_1.bias", False),
    "attention.qkv.weight": ("attn.c_attn.weight", True), "attention.qkv.bias": ("attn.c_attn.bias", False),
    "attention.dense.weight": ("attn.c_proj.weight", True), "attention.dense.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False),
    "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.dense_h_to_4h.weight": ("mlp.c_fc.weight", True), "mlp.dense_h_to_4h.bias": ("mlp.c_fc.bias", False),
    "mlp.dense_4h_to_h.weight": ("mlp.c_proj.weight", True), "mlp.dense_4h_to_h.bias": ("mlp.c_proj.bias", False),
}
_GLOBAL_MAP = {"embedding.word_embeddings.weight": "transformer.wte.weight",
               "embedding.position_embeddings.weight": "transformer.wpe.weight",
               "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias",
               "output_layer.weight": "lm_head.weight"}
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")      # causal-mask buffers of older GPT-2 files


def hf_config(cfg: GPTConfig) -> dict:
    """GPT2Config fields for a megazero model; refuses anything GPT-2 cannot express."""
    if cfg.activation not in _ACT_TO_HF:
        raise CheckpointError(f"activation {cfg.activation!r} has no GPT-2 equivalent: cannot export to HF")
    if cfg.num_experts:
        raise CheckpointError(f"{FLAG.num_experts} {cfg.num_experts} has no GPT-2 equivalent: an MoE model exports "
                              f"as MixtralForCausalLM, which needs {FLAG.position_embedding_type} rope "
                              f"{FLAG.normalization} RMSNorm {FLAG.swiglu} {FLAG.add_bias_linear}")
    unlike = [what for what, differs in (
        (f"{FLAG.normalization} RMSNorm", cfg.normalization != "LayerNorm"), (FLAG.swiglu, cfg.swiglu),
        (FLAG.group_query_attention, cfg.group_query_attention), (FLAG.add_bias_linear, not cfg.add_bias_linear),
        (f"{FLAG.position_embedding_type} rope", cfg.position_embedding_type != "learned_absolute")) if differs]
    if unlike:
        raise CheckpointError(f"{', '.join(unlike)} has no GPT-2 equivalent: cannot export to GPT2LMHeadModel")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_position_embeddings, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "activation_function": _ACT_TO_HF[cfg.activation], "layer_norm_epsilon": cfg.layernorm_epsilon,
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "torch_dtype": "float32"}


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> GPTConfig:
    """The megazero GPTConfig of a GPT2Config dict; refuses what megazero's GPT does not implement."""
    def refuse(why: str):
        raise CheckpointError(f"cannot import this HF model: {why}")

    if hf.get("model_type", "gpt2") != "gpt2":
        refuse(f"model_type {hf.get('model_type')!r} is not gpt2")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        refuse(f"activation_function {act!r} (megazero has {', '.join(sorted(_ACT_FROM_HF))})")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights=false (megazero always scales attention by 1/sqrt(head_dim))")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refuse("scale_attn_by_inverse_layer_idx=true is not implemented")
    if hf.get("add_cross_attention", False):
        refuse("cross-attention is not implemented")
    h = hf.get("n_embd", 768)
    n_pos = hf.get("n_positions", 1024)
    return GPTConfig(num_layers=hf.get("n_layer", 12), hidden_size=h, num_attention_heads=hf.get("n_head", 12),
                       ffn_hidden_size=hf.get("n_inner") or 4 * h, seq_length=seq_length or n_pos,
                       max_position_embeddings=n_pos, vocab_size=hf.get("vocab_size", 50257),
                       untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                       attention_dropout=hf.get("attn_pdrop", 0.1), hidden_dropout=hf.get("resid_pdrop", 0.1),
                       init_method_std=hf.get("initializer_range", 0.02),
                       layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=_ACT_FROM_HF[act])


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """megazero whole tensors -> GPT2LMHeadModel state dict (tied: no lm_head.weight, as HF saves it)."""
    out, heads = {}, cfg.num_attention_heads
    for name, t in tensors.items():
        if name in _GLOBAL_MAP:
            out[_GLOBAL_MAP[name]] = t
            continue
        _, layer, rest = name.split(".", 2) if name.startswith("layers.") else ("", "", name)
        if rest not in _LAYER_MAP:
            raise CheckpointError(f"megazero tensor {name!r} has no GPT-2 equivalent: cannot export to HF")
        hf_name, transpose = _LAYER_MAP[rest]
        if rest.startswith("attention.qkv"):
            t = qkv_interleaved_to_blocks(t, heads)
        out[f"transformer.h.{layer}.{hf_name}"] = t.t() if transpose else t
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel (or GPT2Model) state dict -> megazero whole tensors; every key must be used."""
    state = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v for k, v in state.items()
             if not k.endswith(_HF_BUFFERS)}
    inverse = {v: k for k, v in _GLOBAL_MAP.items()}
    layer_inverse = {hf: (ours, tr) for ours, (hf, tr) in _LAYER_MAP.items()}
    out, heads = {}, cfg.num_attention_heads
    for key, t in state.items():
        t = t.float()
        if key == "lm_head.weight" and not cfg.untie_embeddings_and_output_weights:
            if not torch.equal(t, state["transformer.wte.weight"].float()):
                raise CheckpointError("lm_head.weight differs from transformer.wte.weight but the config "
                                      "ties them (tie_word_embeddings): the HF checkpoint is inconsistent")
            continue
        if key in inverse:
            out[inverse[key]] = t
            continue
        parts = key.split(".", 3)
        if len(parts) < 4 or parts[1] != "h" or parts[3] not in layer_inverse:
            raise CheckpointError(f"HF tensor {key!r} has no megazero equivalent: refusing to drop it")
        ours, transpose = layer_inverse[parts[3]]
        t = t.t() if transpose else t
        if ours.startswith("attention.qkv"):
            t = qkv_blocks_to_interleaved(t, heads)
        out[f"layers.{parts[2]}.{ours}"] = t.contiguous()
    return out
