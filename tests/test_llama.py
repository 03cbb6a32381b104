"""Llama-family features of the GPT model (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases,
untied output): the documented layouts against textbook formulas, the config rules, and 5 training
steps at tp 2/4 (with and without sequence parallel), pp 2/4 (1F1B and interleaved), dp 2 with ZeRO
1/2/3 and combinations, each equal to the single-process run (fp32, 1e-5 relative)."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import run_on_ranks
from helpers.gpt_parity import (
    GPT_CFG,
    GPT_OPT,
    LLAMA_KW,
    MB_SIZE,
    MICRO,
    SEED,
    check_against_reference,
    gpt_batches,
    trainer_steps,
)

from megazero.config import JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.errors import ConfigError
from megazero.models.gpt import GPT, GPTConfig, build_model_chunks, masked_mean
from megazero.models.gpt.rotary import RotaryEmbedding
from megazero.models.gpt.transformer import interleaved_to_gate_up, kv_interleaved_to_blocks
from megazero.parallel.params import split_dim
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine, wrap_data_parallel

STEPS = 5


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**GPT_CFG, **LLAMA_KW, **kw})


# --------------------------------------------------------------------------- layouts vs textbook math

def _rope_reference(x, positions, base, rot):
    """Rotate pairs (j, j + rot/2) of the first ``rot`` features by position * base^(-2j/rot), as complex numbers."""
    half = rot // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    angle = positions.double()[:, None] * inv[None]                          # [s, half]
    z = torch.complex(x[..., :half].double(), x[..., half:rot].double())
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, None, :]       # x: [s, b, heads, d]
    return torch.cat([z.real, z.imag, x[..., rot:].double()], -1).to(x.dtype)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_rotates_pairs_by_position(percent):
    cfg = _cfg(rotary_percent=percent, rotary_base=500.0, max_position_embeddings=32)
    x = torch.randn(8, 2, 3, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    rope = RotaryEmbedding(cfg)
    want = _rope_reference(x, torch.arange(5, 13), 500.0, cfg.rotary_dim)
    torch.testing.assert_close(rope(x, offset=5), want, rtol=1e-5, atol=1e-6)
    if percent < 1:
        assert torch.equal(rope(x)[..., cfg.rotary_dim:], x[..., cfg.rotary_dim:])


def test_llama3_rope_scaling_slows_only_long_wavelengths():
    from megazero.models.gpt.rotary import inverse_frequencies

    plain = inverse_frequencies(_cfg(position_embedding_type="rope", rotary_base=500000.0, hidden_size=512,
                                     num_attention_heads=4))
    scaled = inverse_frequencies(_cfg(position_embedding_type="rope", rotary_base=500000.0, hidden_size=512,
                                      num_attention_heads=4, use_rope_scaling=True, rope_scaling_factor=8.0))
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 2048], plain[wavelen < 2048])
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)


def _textbook_layer(layer, x, cfg):
    """One Llama block from HF-shaped matrices: RMSNorm, q/k/v projections, RoPE, repeat_kv, causal
    softmax attention, o_proj, RMSNorm, down(silu(gate x) * up x)."""
    s, b, h = x.shape
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w

    attn = layer.attention
    k_proj, v_proj = kv_interleaved_to_blocks(attn.key_value.weight.detach(), groups)
    y = rms(x, layer.input_layernorm.weight.detach())
    q = (y @ attn.query.weight.detach().T).view(s, b, heads, d)
    k = (y @ k_proj.T).view(s, b, groups, d)
    v = (y @ v_proj.T).view(s, b, groups, d)
    pos = torch.arange(s)
    q, k = (_rope_reference(t, pos, cfg.rotary_base, cfg.rotary_dim) for t in (q, k))
    k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))     # query head i -> group i // (heads/G)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1),
                                                                  float("-inf"))
    out = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    x = x + out @ attn.dense.weight.detach().T
    gate, up = interleaved_to_gate_up(layer.mlp.dense_h_to_4h.weight.detach())
    y = rms(x, layer.post_attention_layernorm.weight.detach())
    return x + (F.silu(y @ gate.T) * (y @ up.T)) @ layer.mlp.dense_4h_to_h.weight.detach().T


def test_documented_layouts_match_textbook_llama_block():
    """GroupedQueryAttention's key_value rows and SwiGLU's interleaved gate/up rows, read back through
    the converters' helpers, reproduce a textbook Llama block (the contract the HF conversion relies on)."""
    cfg = _cfg()
    layer = GPT(cfg, seed=SEED).layers["0"]
    with torch.no_grad():
        for p in layer.parameters():                             # norms away from 1
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x).detach(), _textbook_layer(layer, x, cfg), rtol=1e-5, atol=1e-5)


def test_names_shapes_and_init():
    model = GPT(_cfg(), seed=1)
    params = dict(model.named_parameters())
    assert not any(n.endswith(".bias") for n in params) and "embedding.position_embeddings.weight" not in params
    assert params["layers.0.attention.query.weight"].shape == (32, 32)
    assert params["layers.0.attention.key_value.weight"].shape == (2 * 2 * 8, 32)
    assert params["layers.0.mlp.dense_h_to_4h.weight"].shape == (128, 32)
    assert torch.all(params["layers.3.input_layernorm.weight"] == 1) and torch.all(params["final_norm.weight"] == 1)
    assert params["output_layer.weight"].vocab_padded and not params["embedding.word_embeddings.weight"].shared_embedding
    std = params["layers.7.mlp.dense_4h_to_h.weight"].std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.1)


def test_qwen2_style_qkv_bias_only():
    params = dict(GPT(_cfg(add_qkv_bias=True), seed=1).named_parameters())
    biases = sorted(n.split(".", 2)[2] for n in params if n.endswith(".bias") and n.startswith("layers.0."))
    assert biases == ["attention.key_value.bias", "attention.query.bias"]


def test_recompute_gives_same_grads():
    tokens, labels = (torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    grads = []
    for recompute in (False, True):
        model = GPT(_cfg(recompute_activations=recompute), seed=SEED)
        masked_mean(model(tokens, labels), torch.ones(2, 16)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("kw,tp,match", [
    (dict(num_query_groups=3), 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (dict(num_attention_heads=8, num_query_groups=4), 8, None),                    # G < tp, tp % G == 0
    (dict(num_attention_heads=12, hidden_size=48, num_query_groups=6), 4, "--num-query-groups 6 is not divisible"),
    (dict(num_attention_heads=12, hidden_size=48, num_query_groups=4, ffn_hidden_size=96), 6, "is not a multiple of --num-query-groups 4"),
    (dict(group_query_attention=False, num_query_groups=2), 1, "--num-query-groups 2 needs --group-query-attention"),
    (dict(rotary_percent=0.375), 1, "rotates 3 of the 8 features of a head: RoPE needs an even number"),
    (dict(rotary_percent=0.5), 1, None),
    (dict(position_embedding_type="learned_absolute", use_rope_scaling=True), 1, "apply to rotary embeddings only"),
    (dict(normalization="BatchNorm"), 1, "--normalization must be one of LayerNorm, RMSNorm"),
])
def test_config_rules(kw, tp, match):
    job = JobConfig(model=_cfg(**kw), parallel=ParallelConfig(tp=tp))
    if match is None:
        validate(job, world_size=tp)
        return
    with pytest.raises(ConfigError, match=match):
        validate(job, world_size=tp)


def test_swiglu_default_ffn_is_megatrons():
    assert GPTConfig(hidden_size=4096, swiglu=True).ffn_hidden_size == 10880
    assert GPTConfig(hidden_size=4096).ffn_hidden_size == 16384


# --------------------------------------------------------------------------- parallel == serial

def _parity_body(rank, world_size, tp, pp, v, sp, stage, model_kw):
    """Train the Llama-style test model STEPS steps with the trainer's step at this layout; the chunks
    are built on the meta device and materialised by the engine, as the trainer does."""
    topo = Topology(tp=tp, pp=pp)
    cfg = _cfg(**model_kw)
    par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, virtual_stages=v,
                         pipeline_schedule="interleaved" if v > 1 else "1f1b")
    chunks = build_model_chunks(cfg, par, topo, seed=SEED, device="meta")
    engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage), GPT_OPT)
    job = JobConfig(model=cfg, parallel=par, train=TrainConfig(micro_batch_size=MB_SIZE))
    losses, norms, params = trainer_steps(chunks, topo, engine, job, STEPS)
    return topo.tp_rank, topo.tp_size, losses, norms, params


CASES = {  # id: (tp, pp, dp, virtual stages, sequence parallel, ZeRO stage, extra model flags)
    "tp2": (2, 1, 1, 1, False, 0, {}),
    "tp2-sp": (2, 1, 1, 1, True, 0, {}),
    "tp2-sp-zero-centred-norms": (2, 1, 1, 1, True, 0, dict(apply_layernorm_1p=True)),
    "tp4-kv-replicated": (4, 1, 1, 1, False, 0, {}),
    "tp4-sp-kv-replicated": (4, 1, 1, 1, True, 0, {}),
    "pp2-1f1b": (1, 2, 1, 1, False, 0, {}),
    "pp2-interleaved": (1, 2, 1, 2, False, 0, {}),
    "pp4-1f1b": (1, 4, 1, 1, False, 0, {}),
    "pp4-interleaved": (1, 4, 1, 2, False, 0, {}),
    "dp2-zero1": (1, 1, 2, 1, False, 1, {}),
    "dp2-zero2": (1, 1, 2, 1, False, 2, {}),
    "dp2-zero3": (1, 1, 2, 1, False, 3, {}),
    "tp2-pp2-sp-recompute": (2, 2, 1, 1, True, 0, dict(recompute_activations=True)),
    "tp2-dp2-zero3-sp": (2, 1, 2, 1, True, 3, {}),
    "tp4-dp2-zero1-qkv-bias": (4, 1, 2, 1, False, 1, dict(add_qkv_bias=True)),
    "pp2-dp2-zero2-tied": (1, 2, 2, 1, False, 2, dict(untie_embeddings_and_output_weights=False)),
}
QUICK = {"pp4-interleaved", "dp2-zero3"}


@pytest.mark.parametrize("case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_llama_parallel_matches_serial(case):
    """Losses and clipped gradient norms to 1e-5 relative; parameters to 1e-5 relative with an absolute
    floor of 1e-5 (0.5% of one lr=2e-3 step): a few elements whose gradient is ~0 (e.g. the embedding
    row of a token seen once) move by Adam-normalised fp32 noise; the float64 test below shows the
    layouts agree to 1e-10 once rounding is out of the way."""
    tp, pp, dp, v, sp, stage, model_kw = CASES[case]
    results = run_on_ranks(tp * pp * dp, _parity_body, tp, pp, v, sp, stage, model_kw, timeout=300)
    check_against_reference(results, STEPS, dp, {**LLAMA_KW, **model_kw}, param_atol=1e-5)


def _float64_body(rank, world_size, sp):
    """3 AdamW steps (torch's) of the float64 Llama-style model at tp = world_size; every parameter whole."""
    topo = Topology(tp=world_size) if world_size > 1 else None
    model = GPT(_cfg(), topo.model_groups(sp) if topo else None, seed=SEED, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    sync = wrap_data_parallel(model, topo, ZeroConfig()) if topo is not None else None
    for batches in gpt_batches(3, MICRO):
        sync.zero_grad() if sync else opt.zero_grad()
        for mb in batches:
            (masked_mean(model(mb["tokens"], mb["labels"]), mb["loss_mask"]) / MICRO).backward()
        if sync:
            sync.finalize_grads()
        opt.step()
    return {n: gather_full(p.detach(), split_dim(p), model.tp_group).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp,sp", [(2, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_llama_float64_tp_equals_serial_to_1e_10(tp, sp):
    ref = _float64_body(0, 1, False)
    got = run_on_ranks(tp, _float64_body, sp)[0]
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-10, msg=name)
