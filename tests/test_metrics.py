import contextlib
import datetime
import io
import json
import math
import sys

import pytest
from helpers import run_on_ranks
from helpers.trainer import TINY, main_body, read_metrics

from megazero.config import OptimizerConfig
from megazero.lr_schedule import decoupled_learning_rate, learning_rate
from megazero.metrics import MetricsLog, duration, timestamp
from megazero.models.gpt import GPTConfig
from megazero.models.gpt.spec import flops_per_token as model_flops_per_token


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_iters=110, lr_decay_style="cosine")
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(60, cfg) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert learning_rate(110, cfg) == pytest.approx(0.1)
    assert learning_rate(500, cfg) == pytest.approx(0.1)


def test_decoupled_lr_follows_the_same_warmup_and_decay_between_its_own_rates():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, decoupled_lr=3.0, decoupled_min_lr=0.5, lr_warmup_iters=10,
                          lr_decay_iters=110, lr_decay_style="cosine")
    assert [decoupled_learning_rate(i, cfg) for i in (0, 9, 60, 110, 500)] == pytest.approx([0.3, 3.0, 1.75, 0.5, 0.5])
    assert decoupled_learning_rate(60, OptimizerConfig(lr_decay_iters=100)) is None     # not given: they follow --lr
    assert decoupled_learning_rate(100, OptimizerConfig(min_lr=0.2, decoupled_lr=2.0, lr_decay_iters=100)) == 0.2


def test_linear_and_constant_decay():
    lin = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_iters=100, lr_decay_style="linear")
    assert [learning_rate(i, lin) for i in (0, 25, 100)] == pytest.approx([1.0, 0.75, 0.0])
    const = OptimizerConfig(lr=0.5, lr_warmup_iters=4, lr_decay_iters=100, lr_decay_style="constant")
    assert [learning_rate(i, const) for i in (1, 4, 99)] == pytest.approx([0.25, 0.5, 0.5])


def test_flops_match_6n_plus_attention_for_gpt2_small():
    cfg = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024)
    vocab = 50304
    n_matmul = 12 * (12 * 768 * 768) + 768 * vocab
    expected = 6 * n_matmul + 12 * 12 * 1024 * 768
    assert model_flops_per_token(cfg, vocab) == expected
    assert model_flops_per_token(cfg, vocab, recompute=True) > expected


def test_flops_of_a_llama_3_8b_shape():
    """Grouped-query attention (8 KV heads of 128) and SwiGLU's three MLP matrices, untied output."""
    cfg = GPTConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
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
    assert [{k: v for k, v in r.items() if k != "timestamp"} for r in rows] == [{"iteration": 1, "loss": 2.5},
                                                                               {"iteration": 2, "loss": None}]
    for r in rows:                              # every record is stamped with the time of day
        assert abs(datetime.datetime.fromisoformat(r["timestamp"]) - datetime.datetime.now().astimezone()) \
            < datetime.timedelta(minutes=1)
    MetricsLog(str(tmp_path / "other.jsonl"), None, enabled=False).record({"a": 1}, 0)
    assert not (tmp_path / "other.jsonl").exists()


def test_the_first_record_holds_what_the_config_files_resolved(tmp_path):
    from megazero.config import JobConfig, LoggingConfig
    from megazero.reporting import log_header
    from megazero.state import TrainState

    files = {"--deepspeed-config ds.json": {"lr": {"value": 3e-4, "auto": "from --lr"}}}
    log = MetricsLog(str(tmp_path / "m.jsonl"), None, enabled=True)
    log_header(log, JobConfig(logging=LoggingConfig(config_files=files)), TrainState(iteration=40))
    log_header(log, JobConfig(), TrainState())                # no config file: no record
    log.close()
    (record,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert record["iteration"] == 40 and record["config_files"] == files


def test_timestamp_and_duration_formats():
    assert datetime.datetime.fromisoformat(timestamp()).utcoffset() is not None     # ISO 8601 with the offset
    assert [duration(s) for s in (0, 59.6, 3725, 90061)] == ["0:00:00", "0:01:00", "1:02:05", "1 day, 1:01:01"]


STUB_WANDB = """
import json, os
_CALLS = {calls!r}

def _note(call, **kw):
    with open(_CALLS, "a") as f:
        f.write(json.dumps({{"call": call, "rank": int(os.environ["RANK"]), **kw}}) + "\\n")

class _Run:
    def log(self, data, step=None):
        _note("log", data=data, step=step)

    def finish(self):
        _note("finish")

def init(**kwargs):
    _note("init", kwargs=kwargs)
    return _Run()
"""


def _run_printing(rank, world, argv, stub_dir=None):
    """pretrain_gpt.main on this rank (``stub_dir`` first on sys.path), and what it printed."""
    if stub_dir:
        sys.path.insert(0, stub_dir)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main_body(rank, world, argv)
    finally:
        if stub_dir:
            sys.path.remove(stub_dir)
            sys.modules.pop("wandb", None)
    return code, out.getvalue()


def _iteration_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "] iteration " in line]


def test_a_serial_run_logs_elapsed_time_eta_and_no_mfu_without_a_peak(tmp_path):
    """On a CPU with no --peak-tflops the MFU is not a number the run can know: no column, no record,
    one line saying how to get it. Every iteration line starts with its time and gives the elapsed
    time and the ETA (the window's step time x the iterations left); the metrics file has them too."""
    path = tmp_path / "m.jsonl"
    [(code, out)] = run_on_ranks(1, _run_printing, TINY + ["--train-iters", "6", "--metrics-file", str(path)],
                                 timeout=120)
    assert code == 0
    train, valid = read_metrics(path)
    assert [r["iteration"] for r in train] == list(range(1, 7))
    assert all("mfu" not in r for r in train)
    assert " MFU: not shown, the peak FLOP/s of this CPU is not known: give --peak-tflops to show it" in out
    lines = _iteration_lines(out)
    assert len(lines) == 6 and not any("MFU" in line for line in lines)
    for r, line in zip(train, lines):
        assert r["eta_s"] == pytest.approx(r["step_time_s"] * (6 - r["iteration"]))
        assert line.startswith(f" [{r['timestamp'][:10]} ") and f"iteration      {r['iteration']}/6" in line
        assert f"| elapsed {duration(r['elapsed_s'])} | ETA {duration(r['eta_s'])} |" in line
    elapsed = [r["elapsed_s"] for r in train]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0 and train[-1]["eta_s"] == 0
    assert all("timestamp" in r for r in valid)


def test_wandb_logs_rank_0s_metrics_and_mfu_follows_the_given_peak(tmp_path):
    """--wandb-project on two ranks with a stand-in wandb module that records its calls: rank 0 alone
    starts a run (project, name, directory, the job as its config), logs what the metrics file gets at
    each iteration, and finishes it. --peak-tflops gives a CPU an MFU, in the file and on the line."""
    stub, calls, path = tmp_path / "stub", tmp_path / "calls.jsonl", tmp_path / "m.jsonl"
    stub.mkdir()
    (stub / "wandb.py").write_text(STUB_WANDB.format(calls=str(calls)))
    argv = TINY + ["--train-iters", "4", "--eval-interval", "2", "--metrics-file", str(path), "--peak-tflops", "0.5",
                   "--wandb-project", "proj", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb")]
    results = run_on_ranks(2, _run_printing, argv, str(stub), timeout=180)
    assert [code for code, _ in results] == [0, 0]
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert {c["rank"] for c in recorded} == {0}
    init, *logs, finish = recorded
    assert init["call"] == "init" and finish["call"] == "finish" and {c["call"] for c in logs} == {"log"}
    kwargs = init["kwargs"]
    assert (kwargs["project"], kwargs["name"], kwargs["dir"]) == ("proj", "tiny", str(tmp_path / "wb"))
    assert kwargs["config"]["model"]["hidden_size"] == 32 and (tmp_path / "wb").is_dir()
    train, valid = read_metrics(path)
    by_step = {}
    for c in logs:
        by_step.setdefault(c["step"], {}).update(c["data"])
    assert sorted(by_step) == [1, 2, 3, 4]
    for r in train:
        assert by_step[r["iteration"]]["loss"] == r["loss"] and "timestamp" not in by_step[r["iteration"]]
        assert r["mfu"] == pytest.approx(r["tflops_per_rank"] / 0.5)
    assert [by_step[r["iteration"]]["valid_loss"] for r in valid] == [r["valid_loss"] for r in valid]
    lines = _iteration_lines(results[0][1])
    assert len(lines) == 4 and f"| MFU {100 * train[-1]['mfu']:.1f}% |" in lines[-1]
    assert results[1][1] == ""                  # rank 1 prints nothing


def test_mfu_counts_the_models_flops_and_hfu_the_recomputed_ones_beside_it(tmp_path):
    """Under full recompute, TFLOP/s/rank and MFU count the model's FLOPs (3 passes), and HFU beside MFU the
    hardware's (the recomputed forward too: 4 passes of the layers); the metrics file keeps both. Without
    recompute there is no HFU."""
    path = tmp_path / "m.jsonl"
    argv = TINY + ["--train-iters", "2", "--metrics-file", str(path), "--peak-tflops", "0.5",
                   "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    ((code, out),) = run_on_ranks(1, _run_printing, argv, timeout=180)
    assert code == 0
    train, _ = read_metrics(path)
    cfg = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
    ratio = model_flops_per_token(cfg, 112, recompute=1.0) / model_flops_per_token(cfg, 112)
    for r in train:
        assert r["mfu"] == pytest.approx(r["tflops_per_rank"] / 0.5)
        assert r["hardware_tflops_per_rank"] == pytest.approx(ratio * r["tflops_per_rank"])
        assert r["hfu"] == pytest.approx(r["hardware_tflops_per_rank"] / 0.5) and r["hfu"] > r["mfu"]
    assert f"| MFU {100 * train[-1]['mfu']:.1f}% | HFU {100 * train[-1]['hfu']:.1f}% |" in _iteration_lines(out)[-1]
