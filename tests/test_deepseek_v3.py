"""The DeepSeek-V3 family (``--model-family deepseek_v3``): found by the registry with no line outside its
package naming it, its flags and rules, multi-head latent attention equal to HuggingFace's
``DeepseekV3ForCausalLM`` (imported: logits to 1e-5 and the same greedy continuation; exported: HF loads it
and gives our logits), its layouts (tp 2 with sequence parallelism, pp 2, dp 2 under ZeRO 1 and 3, cp 2; with
MTP and DeepSeek's MoE) equal to the serial run over 5 steps, multi-token prediction's loss, and generation from
the compressed cache."""
import dataclasses
import functools

import pytest
import torch
from helpers import run_on_ranks
from helpers.gpt_parity import GPT_OPT, MB_SIZE, MICRO, SEED, gpt_batches, reference_optimizer, trainer_steps

from megazero.checkpoint import load_checkpoint
from megazero.checkpoint.hf import load_hf, save_hf
from megazero.checkpoint.offline import read_model
from megazero.config import JobConfig, ParallelConfig, TrainConfig, ZeroConfig, validate
from megazero.config.model import family, family_names
from megazero.errors import CheckpointError, ConfigError
from megazero.generation import generate, greedy_continuation
from megazero.models.deepseek_v3 import DEEPSEEK_V3_SPEC, DeepSeekV3Config
from megazero.models.deepseek_v3.hf import model_config_from_hf, to_hf_state
from megazero.models.deepseek_v3.yarn import yarn_attention_factor, yarn_inverse_frequencies
from megazero.models.gpt import masked_mean
from megazero.models.gpt.rotary import inverse_frequencies
from megazero.parallel.tensor import gather_full, shard
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import build_model_chunks
from megazero.spec.kv_cache import KVCache

transformers = pytest.importorskip("transformers", reason="the HF comparison needs the test extra")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# A tiny DeepSeek-V3: every MLA part (query bottleneck, latent, shared RoPE key, v head dim != qk head dim), the
# first layer dense, then 8 routed experts and 1 shared, top-2 of the experts of 1 of 2 groups, scaled gates.
HF_TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
               moe_intermediate_size=32, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_interleave=True, num_nextn_predict_layers=0)
MOE_KW = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1], moe_ffn_hidden_size=16,
              moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
              moe_router_topk_scaling_factor=2.0)
MLA_KW = dict(q_lora_rank=8, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=12)  # v != 6 + 4
PARITY_KW = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                 vocab_size=200, make_vocab_size_divisible_by=64, **MLA_KW)


def _load_whole(model, tensors: dict, vocab: int) -> None:
    """Copy whole tensors (parameters and persistent buffers) into a single-process model (the padded
    vocabulary rows stay zero)."""
    assert set(tensors) == set(model.state_dict())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.zero_()
            t[:tensors[name].shape[0]].copy_(tensors[name])


def _whole(model, vocab: int) -> dict:
    """A single-process model's parameters and persistent buffers, whole (without the vocabulary padding)."""
    return {n: (t[:vocab] if n.endswith(("word_embeddings.weight", "output_layer.weight")) else t).detach().clone()
            for n, t in model.state_dict().items()}


def _refused(match: str, tp: int = 1, **kw):
    with pytest.raises(ConfigError, match=match):
        validate(JobConfig(model=DeepSeekV3Config(**kw), parallel=ParallelConfig(tp=tp)), tp)


def test_the_family_is_found_by_name_with_deepseek_defaults():
    assert "deepseek_v3" in family_names() and family("deepseek_v3").spec is DEEPSEEK_V3_SPEC
    cfg = DeepSeekV3Config()
    assert (cfg.model_family, cfg.position_embedding_type, cfg.normalization, cfg.swiglu, cfg.add_bias_linear,
            cfg.untie_embeddings_and_output_weights, cfg.multi_latent_attention) == (
        "deepseek_v3", "rope", "RMSNorm", True, False, True, True)
    validate(JobConfig(model=cfg), 1)


@pytest.mark.parametrize("kw,tp,match", [
    (dict(multi_latent_attention=False), 1, "multi-head latent attention only"),
    (dict(kv_lora_rank=0), 1, "kv_lora_rank|kv-lora-rank"),
    (dict(q_lora_rank=-2), 1, "q_lora_rank|q-lora-rank"),
    (dict(qk_pos_emb_head_dim=5), 1, "must be even"),
    (dict(group_query_attention=True), 1, "latent attention derives"),
    (dict(rotary_percent=0.5), 1, "plain RoPE"),
    (dict(num_attention_heads=6, hidden_size=96), 4, "whole heads"),
    (dict(mtp_num_layers=0), 1, "mtp"),
    (dict(rope_type="yarn", rotary_scaling_factor=0.5), 1, "rotary-scaling-factor must be >= 1"),
    (dict(rope_type="yarn", beta_fast=1.0, beta_slow=1.0), 1, "beta-fast 1.0 must be > --beta-slow"),
    (dict(rope_type="yarn", original_max_position_embeddings=0), 1, "original-max-position-embeddings"),
    (dict(rope_type="yarn", use_rope_scaling=True), 1, "use-rope-scaling"),
])
def test_config_rules(kw, tp, match):
    _refused(match, tp, **kw)


def test_mtp_with_context_parallelism_is_refused():
    with pytest.raises(ConfigError, match="context parallelism splits"):
        validate(JobConfig(model=DeepSeekV3Config(mtp_num_layers=1), parallel=ParallelConfig(cp=2)), 2)


# --------------------------------------------------------------------------- HuggingFace

@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_TINY)).eval()
    with torch.no_grad():                   # nonzero norm weights and expert biases: a swap would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(-0.05, 0.05)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    hf.save_pretrained(path)
    return hf, path


def test_hf_import_gives_hf_logits_and_greedy_continuation(hf_tiny):
    hf, path = hf_tiny
    cfg, tensors = load_hf(path, seq_length=32)
    assert isinstance(cfg, DeepSeekV3Config) and cfg.q_lora_rank == 16 and cfg.moe_layer_freq == [0, 1, 1, 1]
    model = DEEPSEEK_V3_SPEC.build_full(cfg).eval()
    _load_whole(model, tensors, cfg.vocab_size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens)[..., :cfg.vocab_size], hf(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    prompt = tokens[0, :6].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 6:].tolist()
    assert greedy_continuation(model, prompt, 10) == expected


def test_hf_export_loads_in_transformers_with_our_logits(tmp_path):
    """MoE with expert biases and two MTP modules: HF gives our logits (it has no MTP: DeepSeek's layout
    writes them after the decoder), and the export reads back to the same tensors and config."""
    cfg = DeepSeekV3Config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=16,
                           vocab_size=90, mtp_num_layers=2, **MLA_KW, **MOE_KW)
    model = DEEPSEEK_V3_SPEC.build_full(cfg, seed=7).eval()
    with torch.no_grad():
        model.layers["1"].mlp.expert_bias.uniform_(-0.05, 0.05)
    tensors = _whole(model, cfg.vocab_size)
    save_hf(tmp_path / "hf", tensors, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens)[..., :cfg.vocab_size], rtol=1e-5, atol=1e-5)
    back_cfg, back = load_hf(tmp_path / "hf", seq_length=16)
    assert dataclasses.replace(back_cfg, init_method_std=cfg.init_method_std) == cfg
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


# Base 100 and betas 2 / 0.1 put the ramp of 16 rotated features over pairs 0..5: kept, blended and interpolated.
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=2.0, beta_slow=0.1,
            mscale=1.0, mscale_all_dim=0.707, rope_theta=100.0)


def test_hf_yarn_import_gives_hf_logits_beyond_the_original_context_and_exports_back(tmp_path):
    """YaRN with a ramp over the rotated pairs (original context 8, sequence 32): HF's logits at every position,
    with the latent cache's greedy continuation, and the exported config reads back to the same flags."""
    dims = dict(HF_TINY, num_hidden_layers=2, first_k_dense_replace=2, qk_rope_head_dim=16)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**dims, rope_parameters=YARN)).eval()
    hf.save_pretrained(tmp_path / "in")
    cfg, tensors = load_hf(tmp_path / "in", seq_length=32)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.original_max_position_embeddings, cfg.mscale,
            cfg.mscale_all_dim) == ("yarn", 4.0, 8, 1.0, 0.707)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config)
    ramp = yarn_inverse_frequencies(cfg) / inverse_frequencies(cfg)
    assert ramp[0] == 1 and ramp[-1] == 0.25 and ((ramp > 0.25) & (ramp < 1)).sum() >= 3
    torch.testing.assert_close(yarn_inverse_frequencies(cfg), hf_inv_freq, rtol=1e-6, atol=0)
    assert yarn_attention_factor(cfg) == pytest.approx(hf_factor, rel=1e-12)
    model = DEEPSEEK_V3_SPEC.build_full(cfg).eval()
    _load_whole(model, tensors, cfg.vocab_size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens)[..., :cfg.vocab_size], hf(tokens).logits
        plain = DEEPSEEK_V3_SPEC.build_full(dataclasses.replace(cfg, rope_type="rope")).eval()
        _load_whole(plain, tensors, cfg.vocab_size)
        assert not torch.allclose(plain(tokens)[..., :cfg.vocab_size], theirs, atol=1e-3)   # YaRN matters
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    prompt = tokens[0, :12].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 12:].tolist()
    assert greedy_continuation(model, prompt, 8) == expected
    save_hf(tmp_path / "out", tensors, cfg)
    back_cfg, _ = load_hf(tmp_path / "out", seq_length=32)
    assert back_cfg == cfg


def test_hf_import_refuses_other_rope_scaling(tmp_path):
    with pytest.raises(CheckpointError, match="rope scaling .*linear"):
        model_config_from_hf(dict(HF_TINY, rope_scaling={"rope_type": "linear", "factor": 2.0}))


BIAS = "mlp.gate.e_score_correction_bias"


def _convert(*args):
    from tools.convert_checkpoint import main as convert

    assert convert([str(a) for a in args]) == 0


def _loaded_at_tp2_body(rank, world_size, load_dir, tokens):
    """Load the checkpoint at tp 2 as the trainer does (weights only): (the full logits of ``tokens``, the
    routers' expert biases) on tp rank 0."""
    topo = Topology(tp=2)
    cfg = read_model(load_dir)[0]
    job = validate(JobConfig(model=cfg, parallel=ParallelConfig(tp=2)), world_size)
    [chunk] = build_model_chunks(DEEPSEEK_V3_SPEC, job, topo)
    load_checkpoint(load_dir, chunks=[chunk], engine=None, topo=topo, job=job, weights_only=True)
    with torch.no_grad():
        logits = gather_full(chunk.eval()(tokens), 2, topo.tp_group)[..., :cfg.vocab_size]
    biases = {n: b.clone() for n, b in chunk.named_buffers() if n.endswith("expert_bias")}
    return (logits, biases) if topo.tp_rank == 0 else None


def test_converter_carries_the_expert_bias_both_ways(hf_tiny, tmp_path):
    """An HF DeepSeek-V3 MoE checkpoint with nonzero expert biases converted to a megazero checkpoint split for
    tp 2 (``--check``: our model with the biases gives HF's logits): loaded at tp 2 by the trainer's load, HF's logits (1e-5) and its biases bitwise; converted back to HF,
    transformers gives the same logits and the same biases bitwise."""
    hf, path = hf_tiny
    _convert("--input", path, "--output", tmp_path / "mz", "--to", "megazero", "--target-tp", 2,
             "--seq-length", 32, "--check")              # --check runs our model with the biases too
    tokens = torch.randint(0, HF_TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
    theirs = {n: b for n, b in hf.named_buffers() if n.endswith(BIAS)}
    assert len(theirs) == 3 and all(b.abs().sum() > 0 for b in theirs.values())
    [(logits, biases)] = [r for r in run_on_ranks(2, _loaded_at_tp2_body, str(tmp_path / "mz"), tokens) if r]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert len(biases) == 3
    for name, b in biases.items():
        assert b.dtype == torch.float32 and torch.equal(b, theirs[f"model.{name.replace('mlp.router.expert_bias', BIAS)}"])
    _convert("--input", tmp_path / "mz", "--output", tmp_path / "hf", "--to", "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    for name, b in back.named_buffers():
        if name.endswith(BIAS):
            assert torch.equal(b, theirs[name]), name


# --------------------------------------------------------------------------- parallel == serial

STEPS = 5
# YaRN with its ramp inside the rotated part and both magnitudes != 1 (sequence 16 is 4x the original context)
YARN_KW = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=4, beta_fast=2.0,
               beta_slow=0.1, mscale_all_dim=0.707, rotary_base=100.0)
LAYOUTS = {  # id: (tp, pp, sequence parallel, ZeRO stage, extra model flags[, other parallel settings]); 2 ranks

    "tp2-sp": (2, 1, True, 0, {}),
    "tp2-plain-q": (2, 1, False, 0, dict(q_lora_rank=None)),
    "pp2-1f1b": (1, 2, False, 0, {}),
    "dp2-zero1": (1, 1, False, 1, {}),
    "dp2-zero3": (1, 1, False, 3, {}),
    "tp2-sp-mtp": (2, 1, True, 0, dict(mtp_num_layers=2)),
    "pp2-1f1b-mtp": (1, 2, False, 0, dict(mtp_num_layers=2)),
    "dp2-zero3-mtp": (1, 1, False, 3, dict(mtp_num_layers=1)),
    "pp2-interleaved-mtp": (1, 2, False, 1, dict(mtp_num_layers=1),
                            dict(num_layers_per_virtual_pipeline_stage=1, pipeline_schedule="interleaved")),
    "cp2-p2p": (1, 1, False, 0, {}, dict(cp=2, cp_comm_type="p2p")),
    "cp2-p2p-yarn": (1, 1, False, 0, YARN_KW, dict(cp=2, cp_comm_type="p2p")),
    "tp2-sp-yarn": (2, 1, True, 0, YARN_KW),
    "cp2-a2a": (1, 1, False, 0, {}, dict(cp=2, cp_comm_type="a2a")),
    "cp2-allgather": (1, 1, False, 0, {}, dict(cp=2, cp_comm_type="allgather")),
    "tp2-sp-moe": (2, 1, True, 0, {**MOE_KW, "moe_layer_freq": "([0]*1+[1]*3)",
                                   "moe_router_enable_expert_bias": False}),
    "dp2-zero3-moe-grouped": (1, 1, False, 3, {**MOE_KW, "moe_layer_freq": "([0]*1+[1]*3)",
                                               "moe_router_enable_expert_bias": False, "moe_grouped_gemm": True}),
    "ep2-zero3-moe": (1, 1, False, 3, {**MOE_KW, "moe_layer_freq": "([0]*1+[1]*3)",
                                       "moe_router_enable_expert_bias": False},
                      dict(expert_model_parallel_size=2)),
    "pp2-zb-h1-moe-mtp": (1, 2, False, 0, {**MOE_KW, "moe_layer_freq": "([0]*1+[1]*3)", "mtp_num_layers": 1,
                                           "moe_router_enable_expert_bias": False},
                          dict(pipeline_schedule="zb-h1")),
}


@functools.lru_cache(maxsize=4)
def _serial_reference(model_kw: tuple, dp: int):
    """STEPS steps of the whole model in one process with torch's AdamW and clip_grad_norm_."""
    model = DEEPSEEK_V3_SPEC.build_full(DeepSeekV3Config(**{**PARITY_KW, **dict(model_kw)}), seed=SEED)
    opt = reference_optimizer(model)
    loss_of = DEEPSEEK_V3_SPEC.loss
    losses, norms = [], []
    for batches in gpt_batches(STEPS, dp * MICRO):
        total = 0.0
        for mb in batches:
            loss = loss_of(model(mb["tokens"], mb["labels"]), mb["loss_mask"])
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GPT_OPT.clip_grad)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _layouts_body(rank, world_size, names):
    """Each layout of ``names`` in turn on these 2 ranks, through the trainer's step, the chunks built on the
    meta device and materialised by the engine as the trainer does."""
    out = {}
    for name in names:
        tp, pp, sp, stage, model_kw, *other = LAYOUTS[name]
        par_kw = other[0] if other else {}
        topo = Topology(tp=tp, pp=pp, cp=par_kw.get("cp", 1), ep=par_kw.get("expert_model_parallel_size", 1))
        par = ParallelConfig(tp=tp, pp=pp, dp=topo.dp_size, sequence_parallel=sp, **par_kw)
        job = validate(JobConfig(model=DeepSeekV3Config(**{**PARITY_KW, **model_kw}), parallel=par,
                                 train=TrainConfig(micro_batch_size=MB_SIZE, seed=SEED)), world_size)
        chunks = build_model_chunks(DEEPSEEK_V3_SPEC, job, topo, device="meta")
        engine = build_engine(chunks, topo, ZeroConfig(zero_stage=stage), GPT_OPT)
        losses, norms, params = trainer_steps(chunks, topo, engine, job, STEPS)
        out[name] = (topo.tp_rank, topo.tp_size, losses, norms, params)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_serial(name):
    """tp 2 (with sequence parallelism, and with a plain query projection), pp 2 (1F1B), dp 2 under ZeRO 1
    and 3, with MTP tp 2 + SP, pp 2 (the last stage's copy of the embedding; 1F1B, and interleaved under ZeRO 1)
    and ZeRO 3, and DeepSeek's MoE
    (sigmoid group-limited routing, a shared expert, the first layer dense) at tp 2 + SP and, with grouped GEMM
    experts, ZeRO 3, at ep 2 under ZeRO 3, and with MTP at pp 2 under zero-bubble H1, cp 2 by each comm type
    (the value head dim differs from the query/key one), YaRN RoPE at cp 2 and tp 2 + SP: losses and
    clipped gradient norms to 1e-5 relative, every parameter to 1e-5 relative (absolute floor 1e-5, as the
    Llama parity tests: Adam-normalised noise of elements whose gradient is ~0)."""
    tp, pp, _, _, model_kw, *other = LAYOUTS[name]
    results = run_on_ranks(2, _layouts_body, [name], timeout=180)
    dp = 2 // (tp * pp * (other[0].get("cp", 1) if other else 1))
    ref_losses, ref_norms, ref_params = _serial_reference(tuple(sorted(model_kw.items())), dp)
    assert max(ref_norms) > GPT_OPT.clip_grad, "clipping should be active in this test"
    seen = set()
    for rank_result in results:
        tp_rank, tp_size, losses, norms, params = rank_result[name]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        for pname, (value, pdim) in params.items():
            torch.testing.assert_close(value, shard(ref_params[pname], pdim, tp_rank, tp_size), rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"{pname}: {m}")
            seen.add(pname)
    assert seen == set(ref_params), f"parameters never compared: {set(ref_params) - seen}"


# --------------------------------------------------------------------------- multi-token prediction

def test_mtp_loss_is_the_textbook_sum_over_modules():
    """Module k at position t reads token t+k (labels[t+k-1]) and the previous module's state at t and
    predicts token t+k+1, over the positions that have one: computed here on sequences cut to those
    positions (causal attention makes the cut exact), against the model's rolled, masked form."""
    cfg = DeepSeekV3Config(**{**PARITY_KW, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3})
    model = DEEPSEEK_V3_SPEC.build_full(cfg, seed=3)
    g = torch.Generator().manual_seed(8)
    tokens, labels = torch.randint(0, 200, (2, 16), generator=g), torch.randint(0, 200, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.3).float()
    with torch.no_grad():
        got = DEEPSEEK_V3_SPEC.loss(model(tokens, labels), mask)
        h = model.embedding(tokens)
        for layer in model.layers.values():
            h = layer(h)
        expected = masked_mean(model(tokens, labels)[..., 0], mask)
        for k, module in enumerate(model.mtp.values(), start=1):
            s = 16 - k
            emb = model.embedding(labels[:, k - 1:k - 1 + s])
            both = torch.cat((module.enorm(emb), module.hnorm(h[:s])), dim=-1)
            h = module.layer(both @ module.eh_proj.weight.t())
            logits = (module.final_norm(h) @ model.output_layer.weight.t())[..., :200].transpose(0, 1)
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 200), labels[:, k:].reshape(-1),
                                                   reduction="none").view(2, s)
            expected = expected + 0.3 / 2 * (ce * mask[:, k:]).sum() / mask[:, k:].sum()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_generation_caches_the_compressed_latent():
    """Each layer caches R_kv + D_r numbers per token (the normed latent, the rotated shared key part), not
    every head's keys and values; cached generation equals generation that reruns the whole prefix."""
    cfg = DeepSeekV3Config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=32,
                           vocab_size=90, **MLA_KW)
    model = DEEPSEEK_V3_SPEC.build_full(cfg, seed=1).eval()
    prompt = [3, 5, 7, 11, 2]
    assert generate(model, prompt, 12, use_cache=True) == generate(model, prompt, 12, use_cache=False)
    cache = KVCache(cfg.max_position_embeddings)
    with torch.no_grad():
        model(torch.tensor([prompt]), kv_cache=cache)
    layer = cache.layer(0)
    assert layer.keys.shape == (1, 1, 32, cfg.kv_lora_rank) and layer.values.shape == (1, 1, 32, 4)


def test_the_log_line_reports_each_training_mtp_loss_unscaled():
    cfg = DeepSeekV3Config(**{**PARITY_KW, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3})
    model = DEEPSEEK_V3_SPEC.build_full(cfg, seed=3)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(tokens, tokens)
    main = masked_mean(out[..., 0], torch.ones(2, 16))
    loss = DEEPSEEK_V3_SPEC.loss(out, torch.ones(2, 16))
    assert len(model.mtp_record) == 2
    torch.testing.assert_close(loss, main + 0.3 / 2 * sum(model.mtp_record), rtol=1e-6, atol=0)
    with torch.no_grad():                                   # evaluation records nothing
        DEEPSEEK_V3_SPEC.loss(model(tokens, tokens), torch.ones(2, 16))
    assert len(model.mtp_record) == 2
    line = DEEPSEEK_V3_SPEC.hooks.describe_metrics({"mtp_loss": 2.5})
    assert line == " | mtp loss 2.5000"


def test_export_without_the_expert_bias_is_refused_not_zeroed():
    """A source holding parameters only (a weights checkpoint) lacks the router's expert bias, a buffer: the
    export refuses rather than writing HF's bias as zeros."""
    cfg = DeepSeekV3Config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=16,
                           vocab_size=90, **MLA_KW, **MOE_KW)
    model = DEEPSEEK_V3_SPEC.build_full(cfg)
    with pytest.raises(CheckpointError, match="expert_bias is not among the tensors"):
        to_hf_state({n: p.detach() for n, p in model.named_parameters()}, cfg)


# --------------------------------------------------------------------------- memory estimate

ESTIMATE_SHAPE = ["--model-family", "deepseek_v3", "--mock-data", "--vocab-size", "500", "--num-layers", "4",
                  "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length",
                  "128", "--micro-batch-size", "4", "--q-lora-rank", "32", "--kv-lora-rank", "48", "--qk-head-dim",
                  "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
ESTIMATE_LAYOUTS = {  # id: (world size, flags)
    "serial": (1, ["--zero-stage", "0"]),
    "tp2-sp": (2, ["--tp", "2", "--sequence-parallel", "--zero-stage", "0"]),
    "pp2-mtp": (2, ["--pp", "2", "--zero-stage", "0", "--global-batch-size", "8", "--mtp-num-layers", "2"]),
    "tp2-mtp-core_attn": (2, ["--tp", "2", "--zero-stage", "1", "--mtp-num-layers", "1",
                              "--recompute-granularity", "selective"]),
}


@pytest.mark.parametrize("name", list(ESTIMATE_LAYOUTS))
def test_estimate_is_within_10_percent_of_measured(name):
    """The estimator's per-rank peak against live tensor bytes measured over construction and a training step
    (as the GPT family's, tests/test_memory.py), and its terms: the model states against the bytes alive after
    the step, the activations and buffers against the rest of the peak, each within 10% of the measured peak
    (printed)."""
    from helpers.memory import estimate_errors

    world, flags = ESTIMATE_LAYOUTS[name]
    errors = {}
    for pp_rank, (est, errors[pp_rank]) in estimate_errors(ESTIMATE_SHAPE + flags, world).items():
        assert est.activations + est.buffers >= 0.4 * est.total
        print(f"{name} stage {pp_rank}:", {k: f"{v:+.1%}" for k, v in errors[pp_rank].items()})
    assert all(abs(v) <= 0.10 for stage in errors.values() for v in stage.values()), errors


HELD_CHOICES = {  # id: flags on ESTIMATE_SHAPE (one process): what the activation model counts differently
    "mla": [],
    "plain-q-mtp2": ["--mtp-num-layers", "2"],
    "core_attn": ["--recompute-granularity", "selective"],
    "full-recompute": ["--recompute-activations"],
    "fused-kernel": ["--v-head-dim", "24"],                 # D_v = D_nope + D_r: the fused kernel on a CPU too
    "attention-dropout": ["--attention-dropout", "0.1"],
}


def _held_body(rank, world_size, argvs):
    """For each argv: the live tensor bytes one micro-batch's forward leaves held (the loss and its inputs'
    graph), gradients already allocated."""
    from megazero.cli.job import parse_job
    from megazero.memory import LiveTensorBytes

    out = {}
    for name, argv in argvs.items():
        job, _ = parse_job(argv, world_size)
        [chunk] = build_model_chunks(DEEPSEEK_V3_SPEC, job, Topology())
        b, s, v = job.train.micro_batch_size, job.model.seq_length, job.model.vocab_size
        g = torch.Generator().manual_seed(0)
        tokens, labels = (torch.randint(0, v, (b, s), generator=g) for _ in range(2))
        mask = torch.ones(b, s)
        DEEPSEEK_V3_SPEC.loss(chunk(tokens, labels), mask).backward()
        with LiveTensorBytes() as forward:
            loss = DEEPSEEK_V3_SPEC.loss(chunk(tokens, labels), mask)
        out[name] = forward.end
        del loss, chunk
    return out


def test_held_activations_are_what_the_estimate_says():
    """On one process, per activation choice: the bytes one forward leaves held against the activation model's
    ``held`` (latent attention's parts, the MTP modules, selective and full recompute, either attention kernel),
    each within 10% (printed)."""
    from megazero.cli.job import parse_job
    from megazero.parallel.pipeline.partition import placements

    model = DEEPSEEK_V3_SPEC.activation_bytes
    at = ESTIMATE_SHAPE.index("--q-lora-rank")
    plain_q = ESTIMATE_SHAPE[:at] + ESTIMATE_SHAPE[at + 2:]
    argvs = {name: (plain_q if "plain-q" in name else ESTIMATE_SHAPE) + ["--zero-stage", "0"] + flags
             for name, flags in HELD_CHOICES.items()}
    [measured] = run_on_ranks(1, _held_body, argvs)
    errors = {}
    for name, argv in argvs.items():
        job, _ = parse_job(argv, 1)
        [place] = placements(job.model.num_layers, 1, 0)
        errors[name] = model.held(job, place, 4, 4) / measured[name] - 1
    print("held error by choice:", {n: f"{e:+.1%}" for n, e in errors.items()})
    assert all(abs(e) <= 0.10 for e in errors.values()), errors
