"""Generation: logit filtering, greedy decoding against a step-by-step reference (and against
``transformers`` when installed), reproducible sampling, the KV cache against cache-free decoding
(GPT-2 and Llama-style models), and the generate / inspect tools."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megazero.checkpoint.offline import build_full_model, write_weights_checkpoint
from megazero.config import JobConfig
from megazero.generation import filter_logits, generate, next_token
from megazero.models.gpt import GPT, GPTConfig
from megazero.spec.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, make_vocab_size_divisible_by=64)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
             group_query_attention=True, num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)


def _checkpoint(path, vocab_size=100, **kw):
    """A weights-only checkpoint of a randomly perturbed tiny GPT (files split for tp2 pp2)."""
    cfg = GPTConfig(**{**CFG, "vocab_size": vocab_size, **kw})
    model = GPT(cfg, seed=7)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        tensors[name] = t[:vocab_size] if p.vocab_padded else t
    write_weights_checkpoint(path, tensors, JobConfig(model=cfg), tp=2, pp=2)
    return path


def _tool(name, *args):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def test_filter_logits():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.equal(filter_logits(logits, top_k=2), torch.tensor([float("-inf"), 4.0, 3.0, float("-inf")]))
    probs = torch.softmax(logits, -1)                       # 0.03, 0.64, 0.24, 0.09
    kept = filter_logits(logits, top_p=0.7).isfinite()
    assert kept.tolist() == [False, True, True, False] and probs[1] < 0.7 <= probs[1] + probs[2]
    assert filter_logits(logits, top_p=0.5).isfinite().tolist() == [False, True, False, False]
    assert next_token(logits) == 1 and next_token(logits, top_k=1, generator=torch.Generator()) == 1


def test_greedy_matches_step_by_step_argmax(tmp_path):
    model, _ = build_full_model(_checkpoint(tmp_path))
    prompt = [3, 14, 15, 92]
    new = generate(model, prompt, 24)                       # runs past the 16-token window
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1, :100].argmax()))
    assert new == ids[len(prompt):] and len(new) == 24


def test_sampling_is_reproducible_and_respects_top_k(tmp_path):
    model, _ = build_full_model(_checkpoint(tmp_path))
    a = generate(model, [1, 2], 12, top_k=5, temperature=2.0, generator=torch.Generator().manual_seed(0))
    b = generate(model, [1, 2], 12, top_k=5, temperature=2.0, generator=torch.Generator().manual_seed(0))
    assert a == b
    ids = [1, 2]
    with torch.no_grad():
        for tok in a:
            top5 = model(torch.tensor([ids]))[0, -1, :100].topk(5).indices.tolist()
            assert tok in top5
            ids.append(tok)
    assert generate(model, [1, 2], 6, top_k=1, generator=torch.Generator()) == generate(model, [1, 2], 6)
    with pytest.raises(ValueError, match="prompt token ids"):
        generate(model, [1, 100], 3)


def test_greedy_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs the test extra: pip install transformers")
    from megazero.checkpoint.hf import save_hf
    from megazero.checkpoint.offline import read_model

    ckpt = _checkpoint(tmp_path / "mz")
    cfg, tensors, _ = read_model(ckpt)
    save_hf(tmp_path / "hf", tensors, cfg)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = [5, 6, 7]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones(1, 3, dtype=torch.long))
    model, _ = build_full_model(ckpt)
    assert generate(model, prompt, 10) == out[0, 3:].tolist()


@pytest.mark.slow
def test_generate_and_inspect_tools(tmp_path):
    ckpt = _checkpoint(tmp_path / "c", vocab_size=4000)     # the embedded sample tokenizer's vocabulary
    model, _ = build_full_model(ckpt)
    expected = generate(model, [5, 17, 42], 5)
    rc, out = _tool("generate.py", "--load", ckpt, "--prompt-ids", "5,17,42", "--max-new-tokens", 5)
    assert rc == 0 and f"new ids: {','.join(map(str, expected))}" in out, out
    rc, out = _tool("generate.py", "--load", ckpt, "--prompt", "The hacker", "--max-new-tokens", 4,
                    "--top-k", 10, "--top-p", 0.9)
    assert rc == 0 and "text: The hacker" in out, out
    rc, out = _tool("inspect_checkpoint.py", ckpt)
    assert rc == 0 and "saved with: tp 2 pp 2" in out and "checksums OK" in out, out
    assert "model/layers.1.attention.qkv.weight" in out and "[96, 32]" in out
    shard = ckpt / "iter_0000000" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out = _tool("inspect_checkpoint.py", ckpt)
    assert rc == 1 and str(shard) in out, out


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_kv_cache_logits_equal_full_forward(style, tmp_path):
    """Prefill 5 tokens, then 3 at once, then one at a time: every position's logits equal the
    cache-free forward over the whole sequence."""
    model, _ = build_full_model(_checkpoint(tmp_path, **(LLAMA if style == "llama" else {})))
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)
        cache, parts = KVCache(model.cfg.max_position_embeddings), []
        for a, b in ((0, 5), (5, 8), (8, 9), (9, 10), (10, 12)):
            parts.append(model(ids[:, a:b], kv_cache=cache))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, 1)[..., :100], full[..., :100], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_kv_cache_generation_equals_cache_free(style, tmp_path):
    """Token for token, greedy and sampled, also past the 16-position window (where the cache is
    refilled from the window each step)."""
    model, _ = build_full_model(_checkpoint(tmp_path, **(LLAMA if style == "llama" else {})))
    for prompt, n, kw in (([3, 14, 15, 92], 24, {}), ([7], 10, {}), ([1, 2, 3], 20, dict(top_k=8, temperature=1.5))):
        runs = [generate(model, prompt, n, use_cache=c, generator=torch.Generator().manual_seed(9), **kw)
                for c in (True, False)]
        assert runs[0] == runs[1] and len(runs[0]) == n
