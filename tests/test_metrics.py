import json
import math

import pytest

from megazero.config import ModelConfig, OptimizerConfig
from megazero.metrics import MetricsLog
from megazero.models.gpt_spec import flops_per_token as model_flops_per_token
from megazero.lr_schedule import learning_rate


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_iters=110, lr_decay_style="cosine")
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(60, cfg) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert learning_rate(110, cfg) == pytest.approx(0.1)
    assert learning_rate(500, cfg) == pytest.approx(0.1)


def test_linear_and_constant_decay():
    lin = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_iters=100, lr_decay_style="linear")
    assert [learning_rate(i, lin) for i in (0, 25, 100)] == pytest.approx([1.0, 0.75, 0.0])
    const = OptimizerConfig(lr=0.5, lr_warmup_iters=4, lr_decay_iters=100, lr_decay_style="constant")
    assert [learning_rate(i, const) for i in (1, 4, 99)] == pytest.approx([0.25, 0.5, 0.5])


def test_flops_match_6n_plus_attention_for_gpt2_small():
    cfg = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024)
    vocab = 50304
    n_matmul = 12 * (12 * 768 * 768) + 768 * vocab
    expected = 6 * n_matmul + 12 * 12 * 1024 * 768
    assert model_flops_per_token(cfg, vocab) == expected
    assert model_flops_per_token(cfg, vocab, recompute=True) > expected


def test_flops_of_a_llama_3_8b_shape():
    """Grouped-query attention (8 KV heads of 128) and SwiGLU's three MLP matrices, untied output."""
    cfg = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                      num_query_groups=8, swiglu=True, ffn_hidden_size=14336, seq_length=8192)
    vocab = 128256
    n_matmul = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * vocab
    assert model_flops_per_token(cfg, vocab) == 6 * n_matmul + 12 * 32 * 8192 * 4096
    assert 7.5e9 < n_matmul < 7.6e9            # Llama 3 8B: 8.03B parameters, 0.53B of them the input embedding


def test_metrics_file_is_json_lines(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    log = MetricsLog(str(path), None, enabled=True)
    log.record({"iteration": 1, "loss": 2.5}, 1)
    log.record({"iteration": 2, "loss": math.inf}, 2)
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"iteration": 1, "loss": 2.5}, {"iteration": 2, "loss": None}]
    MetricsLog(str(tmp_path / "other.jsonl"), None, enabled=False).record({"a": 1}, 0)
    assert not (tmp_path / "other.jsonl").exists()
