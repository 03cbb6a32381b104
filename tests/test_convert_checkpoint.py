"""HuggingFace conversion, GPT-2 and Llama family: megazero (tp2 pp2) -> HF -> megazero is exact, the HF
export gives the same logits in ``transformers``, and an HF model made by ``transformers`` gives the
same logits (and, for Llama, the same greedy generation) when imported and run at tp2 pp2; sharded
safetensors both ways. Needs the ``transformers`` test extra (skipped, with the reason, without it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from helpers.ckpt import MODEL, VOCAB, make_job, run_body

from megazero.checkpoint import load_checkpoint
from megazero.checkpoint.hf import load_hf, model_config_from_hf
from megazero.checkpoint.offline import build_full_model, read_model, write_weights_checkpoint
from megazero.config import JobConfig
from megazero.errors import CheckpointError
from megazero.generation import generate
from megazero.models.gpt import GPT, GPTConfig, build_model_chunks
from megazero.parallel.tensor import gather_full
from megazero.parallel.topology import Topology

transformers = pytest.importorskip("transformers", reason="HF round trip needs the test extra: pip install transformers")
ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, VOCAB, (2, MODEL["seq_length"]), generator=torch.Generator().manual_seed(5))


def _convert(*args):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *map(str, args)],
                         capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def _hf_logits(path):
    model = transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _our_logits(path):
    model, _ = build_full_model(path)
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB]


@pytest.fixture(scope="module")
def trained_tp2pp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2pp2")
    run_on_ranks(4, run_body, 2, 2, 1, 1, str(d), (1,))          # one step at tp2 pp2, then save
    return d


@pytest.mark.slow
def test_megazero_tp2pp2_to_hf_and_back_is_exact(trained_tp2pp2, tmp_path):
    rc, out = _convert("--input", trained_tp2pp2, "--output", tmp_path / "hf", "--to", "hf")
    assert rc == 0, out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == "gelu_new" and config["vocab_size"] == VOCAB
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), _our_logits(trained_tp2pp2), rtol=0, atol=1e-4)
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "back", "--to", "megazero",
                       "--target-tp", 2, "--target-pp", 2)
    assert rc == 0, out
    _, before, _ = read_model(trained_tp2pp2)
    _, after, index = read_model(tmp_path / "back")
    assert index["layout"]["tp"] == 2 and index["layout"]["pp"] == 2 and set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_exact_gelu_and_untied_output_export(tmp_path):
    cfg = GPTConfig(**MODEL, activation="gelu", untie_embeddings_and_output_weights=True)
    model = GPT(cfg, seed=3)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.named_parameters():                   # non-trivial biases and norms
        t = p.detach() + 0.02 * torch.randn(p.shape, generator=g)
        tensors[name] = t[:VOCAB] if name.endswith(("word_embeddings.weight", "output_layer.weight")) else t
    job = make_job(1, 1, 1, 0)
    job.model = cfg
    write_weights_checkpoint(tmp_path / "mz", tensors, job, tp=2, pp=2)
    rc, out = _convert("--input", tmp_path / "mz", "--output", tmp_path / "hf", "--to", "hf")
    assert rc == 0, out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["tie_word_embeddings"] is False
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), _our_logits(tmp_path / "mz"), rtol=0, atol=1e-4)


def _forward_tp2pp2_body(rank, world_size, load_dir, model_cfg):
    """Load at tp2 pp2 and return the full logits of TOKENS (last stage, tp rank 0)."""
    topo = Topology(tp=2, pp=2)
    job = make_job(2, 2, 1, 0)
    job.model = model_cfg
    chunks = build_model_chunks(job.model, job.parallel, topo)
    load_checkpoint(load_dir, chunks=chunks, engine=None, topo=topo, job=job, weights_only=True)
    chunk = chunks[0].eval()
    s, b, h = TOKENS.shape[1], TOKENS.shape[0], model_cfg.hidden_size
    with torch.no_grad():
        if topo.is_first_stage:
            dist.send(chunk(TOKENS).contiguous(), topo.pipeline().next_rank)
            return None
        hidden = torch.empty(s, b, h)
        dist.recv(hidden, topo.pipeline().prev_rank)
        logits = gather_full(chunk(hidden), 2, topo.tp_group)
    return logits[..., :model_cfg.vocab_size] if topo.tp_rank == 0 else None


@pytest.mark.slow
def test_hf_model_imported_at_tp2pp2_gives_the_same_logits(tmp_path):
    hf_cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4, n_inner=96,
                                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():                                       # HF inits biases/LN to 0/1: perturb them
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        expected = hf(TOKENS).logits
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "mz", "--to", "megazero",
                       "--target-tp", 2, "--target-pp", 2, "--seq-length", 16)
    assert rc == 0, out
    cfg, _ = load_hf(tmp_path / "hf", seq_length=16)
    results = run_on_ranks(4, _forward_tp2pp2_body, str(tmp_path / "mz"), cfg)
    got = [r for r in results if r is not None]
    assert len(got) == 1
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-4)


def test_refuses_what_cannot_be_expressed(tmp_path):
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        model_config_from_hf({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(CheckpointError, match="activation_function 'relu'"):
        model_config_from_hf({"activation_function": "relu"})
    rc, out = _convert("--input", tmp_path / "nothing", "--output", tmp_path / "o", "--to", "hf")
    assert rc == 1 and "nothing" in out


# --------------------------------------------------------------------------- Llama family

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
             add_bias_linear=False, rotary_base=500.0, layernorm_epsilon=1e-5)
VARIANTS = {  # megazero flags of each exported variant (on top of LLAMA)
    "gqa-untied": dict(group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=True),
    "mha-tied": dict(),
    "qwen2-qkv-bias": dict(group_query_attention=True, num_query_groups=1, add_qkv_bias=True),
    "biases-llama3-rope-scaling": dict(add_bias_linear=True, use_rope_scaling=True, rope_scaling_factor=4.0,
                                       group_query_attention=True, num_query_groups=2),
}


def _perturbed_checkpoint(path, cfg):
    """A weights-only checkpoint (split for tp2 pp2) of a GPT with every tensor perturbed (norms and biases too)."""
    model = GPT(cfg, seed=3)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        tensors[name] = t[:VOCAB] if p.vocab_padded else t
    write_weights_checkpoint(path, tensors, JobConfig(model=cfg), tp=2, pp=2)
    return path


@pytest.mark.parametrize("variant", [v if v == "gqa-untied" else pytest.param(v, marks=pytest.mark.slow)
                                     for v in VARIANTS])
def test_llama_family_export_gives_transformers_the_same_logits(variant, tmp_path):
    cfg = GPTConfig(**{**MODEL, **LLAMA, **VARIANTS[variant]})
    ckpt = _perturbed_checkpoint(tmp_path / "mz", cfg)
    rc, out = _convert("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf", "--max-shard-size", "40KB")
    assert rc == 0, out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM" if variant.startswith("qwen2") else "LlamaForCausalLM"]
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()          # sharded above 40 KB
    assert (tmp_path / "hf" / "tokenizer.model").is_file()                       # the sample tokenizer: known
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, _our_logits(ckpt), rtol=0, atol=1e-4)
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "back", "--to", "megazero",
                       "--target-tp", 2, "--target-pp", 2)
    assert rc == 0, out
    (_, before, _), (back_cfg, after, _) = read_model(ckpt), read_model(tmp_path / "back")
    assert set(before) == set(after) and all(torch.equal(before[n], after[n]) for n in before)
    for field in ("group_query_attention", "num_query_groups", "add_bias_linear", "add_qkv_bias", "use_rope_scaling",
                  "rope_scaling_factor", "rotary_base", "untie_embeddings_and_output_weights"):
        assert getattr(back_cfg, field) == getattr(cfg, field), field


def test_zero_centred_norms_export_their_scale_and_import_back_with_the_flag(tmp_path):
    """--apply-layernorm-1p: the export writes each norm's scale (stored + 1; transformers gives our logits),
    the import with the flag stores scale - 1 and records the flag; without the flag the scale is kept."""
    cfg = GPTConfig(**{**MODEL, **LLAMA, **VARIANTS["gqa-untied"]}, apply_layernorm_1p=True)
    ckpt = _perturbed_checkpoint(tmp_path / "mz", cfg)
    rc, out = _convert("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf")
    assert rc == 0, out
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, _our_logits(ckpt), rtol=0, atol=1e-4)
    _, before, _ = read_model(ckpt)
    torch.testing.assert_close(hf.model.norm.weight.detach(), before["final_norm.weight"] + 1, rtol=0, atol=0)
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "back", "--to", "megazero",
                       "--apply-layernorm-1p")
    assert rc == 0, out
    back_cfg, after, _ = read_model(tmp_path / "back")
    assert back_cfg.apply_layernorm_1p and set(after) == set(before)
    for name in before:                                   # (w + 1) - 1 rounds in fp32
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-7, msg=name)
    plain, _ = load_hf(tmp_path / "hf")
    assert not plain.apply_layernorm_1p
    rc, out = _convert("--input", ckpt, "--output", tmp_path / "o", "--to", "megazero", "--apply-layernorm-1p")
    assert rc == 1 and "--apply-layernorm-1p applies to an HF --input converted --to megazero" in out


def test_gpt2_adapter_adds_one_to_zero_centred_norm_weights_only():
    from megazero.spec import get_model_spec

    cfg = GPTConfig(**MODEL, apply_layernorm_1p=True)
    tensors = {n: torch.randn(p.shape) for n, p in GPT(cfg, seed=3).named_parameters()}
    hf = get_model_spec("gpt").hf
    state = hf.to_hf_state(tensors, cfg)
    assert torch.equal(state["transformer.h.1.ln_2.weight"], tensors["layers.1.post_attention_layernorm.weight"] + 1)
    assert torch.equal(state["transformer.ln_f.weight"], tensors["final_norm.weight"] + 1)
    assert torch.equal(state["transformer.h.0.ln_1.bias"], tensors["layers.0.input_layernorm.bias"])
    back = hf.from_hf_state(state, cfg)
    for name, t in tensors.items():
        torch.testing.assert_close(back[name], t, rtol=0, atol=1e-6, msg=name)
    plain = hf.to_hf_state(tensors, GPTConfig(**MODEL))
    assert torch.equal(plain["transformer.ln_f.weight"], tensors["final_norm.weight"])


@pytest.mark.slow
def test_hf_llama_imported_at_tp2pp2_gives_the_same_logits_and_generation(tmp_path):
    """A LlamaForCausalLM made by transformers (GQA: 4 heads, 2 KV heads; untied), saved sharded,
    imported at tp2 pp2: logits within 1e-4, greedy generation equal to ``model.generate``; exported
    back (sharded), transformers loads it and gives the same logits."""
    hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():                                       # HF inits norms to 1: perturb everything
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        expected = hf(TOKENS).logits
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "mz", "--to", "megazero",
                       "--target-tp", 2, "--target-pp", 2, "--seq-length", 16)
    assert rc == 0, out
    cfg, _ = load_hf(tmp_path / "hf", seq_length=16)
    assert cfg.group_query_attention and cfg.num_query_groups == 2 and cfg.position_embedding_type == "rope"
    got = [r for r in run_on_ranks(4, _forward_tp2pp2_body, str(tmp_path / "mz"), cfg) if r is not None]
    assert len(got) == 1
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-4)

    prompt = [5, 6, 7]
    theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                         max_new_tokens=12, do_sample=False, pad_token_id=0)
    model, _ = build_full_model(tmp_path / "mz")
    assert generate(model, prompt, 12) == theirs[0, 3:].tolist()

    rc, out = _convert("--input", tmp_path / "mz", "--output", tmp_path / "hf2", "--to", "hf", "--max-shard-size", "50KB")
    assert rc == 0, out
    assert (tmp_path / "hf2" / "model.safetensors.index.json").is_file()
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=0, atol=1e-4)


def test_llama_refusals(tmp_path):
    base = dict(model_type="llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=64, vocab_size=100)
    for extra, match in ((dict(hidden_act="gelu"), "hidden_act 'gelu'"),
                         (dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
                         (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling"),
                         (dict(model_type="mistral", sliding_window=16, max_position_embeddings=64), "sliding_window 16"),
                         (dict(head_dim=16), "head_dim 16")):
        with pytest.raises(CheckpointError, match=match):
            model_config_from_hf({**base, **extra})
    with pytest.raises(CheckpointError, match="--normalization LayerNorm"):
        from megazero.checkpoint.hf import save_hf
        save_hf(tmp_path / "out", {}, GPTConfig(**MODEL, position_embedding_type="rope"))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- round trips with tokenizers

ROUND_TRIP_TEXT = ("A hacker's  jargon, 2,345 entries:\n\tcafé <-> {} and </s> <|endoftext|> <s> stay text. "
                   "Hello world!")


def _gpt2_source(path):
    """A GPT2LMHeadModel with GPT-2's BPE files (vocab.json, merges.txt, as megazero writes them)."""
    from helpers.data import GPT2_MERGES, GPT2_VOCAB

    from megazero.checkpoint.hf_tokenizer import write_tokenizer
    from megazero.config import DataConfig

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB),
                               merge_file=str(GPT2_MERGES)), path)
    return transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=2, n_head=2, n_inner=48,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), transformers.GPT2LMHeadModel


def _llama_source(path):
    """A LlamaForCausalLM (GQA, untied) with the sample corpus's SentencePiece model (tokenizer.model, as
    megazero writes it)."""
    from megazero.checkpoint.hf_tokenizer import write_tokenizer
    from megazero.config import DataConfig

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(DataConfig(), path)
    return transformers.LlamaConfig(vocab_size=4000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), \
        transformers.LlamaForCausalLM


def _qwen2_source(path):
    """A Qwen2ForCausalLM (q/k/v biases, tied) with a Qwen2-style tokenizer.json and its
    tokenizer_config.json (copied as they are on export)."""
    from helpers.hf_tokenizers import qwen2_tokenizer_dir

    from megazero.data.sample import CORPUS

    qwen2_tokenizer_dir(path, Path(CORPUS).read_text()[:60000], vocab_size=600)
    return transformers.Qwen2Config(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=True), transformers.Qwen2ForCausalLM


SOURCES = {"gpt2": _gpt2_source, "llama": _llama_source, "qwen2": _qwen2_source}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in SOURCES])   # the full tier
def test_round_trip_through_hf_keeps_tokenizer_ids_and_logits(family, tmp_path):
    """An HF model made by transformers with a tokenizer of each kind (GPT-2 BPE, SentencePiece,
    tokenizer.json), imported and exported again: AutoTokenizer of the source and of the export, and
    megazero's tokenizer of the import, all give the source tokenizer's ids; the imported model and
    the exported one give the source's logits within 1e-5 (fp32); --check agrees both ways."""
    from megazero.checkpoint.hf_tokenizer import run_tokenizer, tokenizer_of

    hf_cfg, cls = SOURCES[family](tmp_path / "hf")
    torch.manual_seed(0)
    source = cls(hf_cfg).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    source.save_pretrained(str(tmp_path / "hf"))
    source_ids = run_tokenizer(tokenizer_of(tmp_path / "hf")).tokenize(ROUND_TRIP_TEXT)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(ROUND_TRIP_TEXT).input_ids == source_ids
    tokens = torch.tensor([source_ids[:16]])
    with torch.no_grad():
        expected = source(tokens).logits

    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "mz", "--to", "megazero",
                       "--seq-length", 16, "--check", "--check-tolerance", 1e-5)
    assert rc == 0 and "AutoTokenizer gives megazero's ids" in out, out
    model, job = build_full_model(tmp_path / "mz")
    assert run_tokenizer(job.data).tokenize(ROUND_TRIP_TEXT) == source_ids
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :hf_cfg.vocab_size], expected, rtol=0, atol=1e-5)

    rc, out = _convert("--input", tmp_path / "mz", "--output", tmp_path / "back", "--to", "hf",
                       "--check", "--check-tolerance", 1e-5)
    assert rc == 0 and "AutoTokenizer gives megazero's ids" in out, out
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))(ROUND_TRIP_TEXT).input_ids == source_ids
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == family
    assert (config["bos_token_id"], config["eos_token_id"]) == {"gpt2": (50256, 50256), "llama": (1, 2),
                                                                  "qwen2": (None, 0)}[family]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_gpt2_export_writes_a_tokenizer_autotokenizer_reads_as_ours(tmp_path):
    """A GPT-2 shaped run on GPT-2's BPE files exports vocab.json, merges.txt and a tokenizer_config.json
    naming GPT2Tokenizer and <|endoftext|>; AutoTokenizer then gives megazero's ids, <|endoftext|> in
    the text included (ordinary text on both sides)."""
    from helpers.data import GPT2_MERGES, GPT2_VOCAB

    from megazero.config import DataConfig
    from megazero.data.tokenizers import GPT2BPETokenizer

    cfg = GPTConfig(**{**MODEL, "vocab_size": 50257, "hidden_size": 16, "num_layers": 2, "num_attention_heads": 2})
    job = JobConfig(model=cfg, data=DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB),
                                               merge_file=str(GPT2_MERGES), data_path=["unused"]))
    tensors = {n: p.detach()[:cfg.vocab_size] if p.vocab_padded else p.detach() for n, p in GPT(cfg, seed=1).named_parameters()}
    write_weights_checkpoint(tmp_path / "mz", tensors, job)
    rc, out = _convert("--input", tmp_path / "mz", "--output", tmp_path / "hf", "--to", "hf", "--check")
    assert rc == 0 and "check ok" in out, out
    tok_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "GPT2Tokenizer" and tok_config["eos_token"] == "<|endoftext|>"
    ids = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(ROUND_TRIP_TEXT).input_ids
    assert ids == GPT2BPETokenizer(str(GPT2_VOCAB), str(GPT2_MERGES)).tokenize(ROUND_TRIP_TEXT)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 50256


@pytest.mark.slow
def test_check_needs_an_hf_side(trained_tp2pp2, tmp_path):
    rc, out = _convert("--input", trained_tp2pp2, "--output", tmp_path / "o", "--to", "megazero", "--check")
    assert rc == 1 and "--check compares a conversion with HF" in out and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- Mixture of Experts (Mixtral)

MOE = dict(num_experts=4, moe_router_topk=2, group_query_attention=True, num_query_groups=2)


@pytest.mark.slow
def test_moe_exports_as_mixtral_and_round_trips(tmp_path):
    """A Llama-family MoE model exports as MixtralForCausalLM: transformers gives its logits (1e-5), and
    importing the export gives back every tensor exactly, at tp2 pp2."""
    cfg = GPTConfig(**{**MODEL, **LLAMA, **MOE})
    ckpt = _perturbed_checkpoint(tmp_path / "mz", cfg)
    rc, out = _convert("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf", "--check",
                       "--check-tolerance", 1e-5)
    assert rc == 0 and "check ok" in out, out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, _our_logits(ckpt), rtol=0, atol=1e-5)
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "back", "--to", "megazero",
                       "--target-tp", 2, "--target-pp", 2)
    assert rc == 0, out
    (_, before, _), (back_cfg, after, _) = read_model(ckpt), read_model(tmp_path / "back")
    assert set(before) == set(after) and all(torch.equal(before[n], after[n]) for n in before)
    assert (back_cfg.num_experts, back_cfg.moe_router_topk) == (4, 2)


@pytest.mark.slow
def test_hf_mixtral_saved_by_transformers_imports(tmp_path):
    """A MixtralForCausalLM made and saved by transformers imports with the same logits."""
    hf_cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
        expected = hf(TOKENS).logits
    hf.save_pretrained(str(tmp_path / "hf"))
    rc, out = _convert("--input", tmp_path / "hf", "--output", tmp_path / "mz", "--to", "megazero", "--seq-length", 16,
                       "--check", "--check-tolerance", 1e-5)
    assert rc == 0 and "check ok" in out, out
    torch.testing.assert_close(_our_logits(tmp_path / "mz"), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flags, match", [
    (dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False, add_bias_linear=True),
     "--num-experts 4 has no GPT-2 equivalent: an MoE model exports as MixtralForCausalLM"),
    (dict(moe_layer_freq=2), "--moe-layer-freq 2"),
    (dict(moe_router_topk=1), "--moe-router-topk 1"),
    (dict(add_qkv_bias=True), "biases")])
def test_moe_export_refuses_what_mixtral_cannot_express(flags, match, tmp_path):
    from megazero.checkpoint.hf import save_hf

    with pytest.raises(CheckpointError, match=match):
        save_hf(tmp_path / "out", {}, GPTConfig(**{**MODEL, **LLAMA, **MOE, **flags}))
    assert not (tmp_path / "out").exists()


def test_mixtral_fused_expert_layout_reads_as_the_published_one():
    """transformers 5's in-memory layout (mlp.gate, experts.gate_up_proj [E, 2f, h], experts.down_proj
    [E, h, f]) imports to the same tensors as the published per-expert w1/w2/w3 layout."""
    from megazero.models.gpt import hf_llama

    cfg = GPTConfig(**{**MODEL, **LLAMA, **MOE})
    tensors = {n: p.detach()[:VOCAB] if p.vocab_padded else p.detach() for n, p in GPT(cfg, seed=4).named_parameters()}
    published = hf_llama.to_hf_state(tensors, cfg)
    fused = {k: v for k, v in published.items() if ".block_sparse_moe." not in k}
    for i in range(cfg.num_layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        fused[new + "gate.weight"] = published[old + "gate.weight"]
        fused[new + "experts.gate_up_proj"] = torch.stack([torch.cat([published[f"{old}experts.{e}.w1.weight"],
                                                                      published[f"{old}experts.{e}.w3.weight"]])
                                                           for e in range(cfg.num_experts)])
        fused[new + "experts.down_proj"] = torch.stack([published[f"{old}experts.{e}.w2.weight"]
                                                        for e in range(cfg.num_experts)])
    a, b = hf_llama.from_hf_state(dict(published), cfg), hf_llama.from_hf_state(fused, cfg)
    assert set(a) == set(b) == set(tensors) and all(torch.equal(a[n], b[n]) and torch.equal(a[n], tensors[n]) for n in a)


@pytest.mark.slow
def test_fine_tuning_an_imported_model_needs_none_of_its_settings_retyped(tmp_path):
    """--use-checkpoint-args on an imported HF Llama: the shape, the sequence length and the tokenizer
    come from the checkpoint (data flags alone), and a fine-tune of it trains."""
    from megazero.cli.job import parse_job

    src = tmp_path / "hf"
    cfg, cls = _llama_source(src)
    torch.manual_seed(0)
    cls(cfg).save_pretrained(src)
    _convert("--input", src, "--output", tmp_path / "mz", "--to", "megazero")
    job, _ = parse_job(["--load", str(tmp_path / "mz"), "--finetune", "--use-checkpoint-args",
                        "--data-path", "corpus_text_document"], 1)
    m, d = job.model, job.data
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.seq_length, m.normalization) == (2, 32, 2, 32, "RMSNorm")
    assert d.tokenizer_type == "SentencePieceTokenizer" and d.tokenizer_model.endswith("tokenizer.model")
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--load", str(tmp_path / "mz"), "--finetune",
                          "--use-checkpoint-args", "--mock-data", "--train-iters", "2", "--micro-batch-size", "1",
                          "--global-batch-size", "1", "--eval-iters", "0"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and "iteration      2/2" in run.stdout, run.stderr[-2000:]


def test_a_checkpoint_recomputing_every_layer_converts_to_more_stages(tmp_path):
    """The run's recompute choice (block recompute of its 4 layers at pp 1) is no part of the weights: the
    conversion to pp 2 (2 layers a stage, where that count would be refused) is not refused for it."""
    cfg = GPTConfig(**MODEL, recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    tensors = {n: p.detach()[:VOCAB] if p.vocab_padded else p.detach() for n, p in GPT(cfg, seed=3).named_parameters()}
    write_weights_checkpoint(tmp_path / "pp1", tensors, JobConfig(model=cfg), tp=1, pp=1)
    rc, out = _convert("--input", tmp_path / "pp1", "--output", tmp_path / "pp2", "--to", "megazero",
                       "--target-pp", "2")
    assert rc == 0, out
    assert torch.equal(read_model(tmp_path / "pp2")[1]["layers.3.mlp.dense_4h_to_h.weight"],
                       tensors["layers.3.mlp.dense_4h_to_h.weight"])
