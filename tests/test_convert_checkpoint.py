"""HuggingFace GPT-2 conversion: megazero (tp2 pp2) -> HF -> megazero is exact, the HF export gives the
same logits in ``transformers``, and an HF model made by ``transformers`` gives the same logits when
imported and run at tp2 pp2. Needs the ``transformers`` test extra (skipped, with the reason, without it)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_on_ranks
from helpers.ckpt import MODEL, VOCAB, make_job, run_body

from megazero.checkpoint import CheckpointError, load_checkpoint
from megazero.checkpoint.hf import load_hf, model_config_from_hf
from megazero.checkpoint.offline import build_full_model, read_model, write_weights_checkpoint
from megazero.config import ModelConfig
from megazero.models import GPT, build_model_chunks
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
    cfg = ModelConfig(**MODEL, activation="gelu", untie_embeddings_and_output_weights=True)
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
            dist.send(chunk(TOKENS).contiguous(), topo.next_rank)
            return None
        hidden = torch.empty(s, b, h)
        dist.recv(hidden, topo.prev_rank)
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
