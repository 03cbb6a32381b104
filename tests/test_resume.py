"""End to end through pretrain_gpt.py: exact resume (20 straight = 10 + stop + 10, bitwise; ZeRO 1/2/3, pipeline,
TP + sequence parallel, dropout), resume under another layout (tp2pp2dp2 ZeRO-1 -> tp1pp4dp2 ZeRO-2,
tp1pp1dp1 ZeRO-3, tp2dp2 ZeRO-3: the same next losses), and a torchrun restart after a rank is killed (the
full suite only); an FP8 delayed run's exact resume (the amax histories restored); in process, a resume that
would change the global batch or the learning-rate schedule, and FP8 settings that are no mismatch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import run_on_ranks
from helpers.trainer import TINY, assert_same_losses, main_body, read_metrics

from megazero.checkpoint import CheckpointReader, latest_iteration
from megazero.checkpoint import format as fmt
from megazero.cli.job import parse_job

ROOT = Path(__file__).resolve().parents[1]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _main(world, argv, timeout=300, stop_after=None):
    body = main_body if stop_after is None else _stopping_main_body
    extra = () if stop_after is None else (stop_after,)
    assert run_on_ranks(world, body, [str(a) for a in argv], *extra, timeout=timeout) == [0] * world


class _Stop(Exception):
    pass


def _stopping_main_body(rank, world, argv, stop_after):
    """pretrain_gpt.main, stopped (as by a scheduler's time limit) once ``stop_after`` steps have run:
    every rank leaves before the next step's first collective."""
    import megazero.training as training
    from megazero.cli import main as cli

    real, calls = training.train_step, []

    def train_step(*args, **kwargs):
        if len(calls) == stop_after:
            raise _Stop
        calls.append(1)
        return real(*args, **kwargs)

    training.train_step = train_step
    try:
        return cli.main(argv)
    except _Stop:
        return 0
    finally:
        training.train_step = real


def _records(path, keys=("loss", "valid_loss", "lr", "grad_norm")):
    train, valid = read_metrics(path)
    return [(r["iteration"],) + tuple(r.get(k) for k in keys) for r in train + valid]


def _assert_same_checkpoints(a: Path, b: Path) -> None:
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert set(ra.tensors) == set(rb.tensors)
    for name in ra.tensors:
        assert torch.equal(ra.read_full(name), rb.read_full(name)), name


@pytest.mark.slow                  # end to end through the launcher: the full suite only
@pytest.mark.parametrize("world,flags", [
    (2, ["--dp", "2", "--zero-stage", "1"] + DROPOUT),
    (4, ["--pp", "2", "--dp", "2", "--zero-stage", "2"] + DROPOUT),
    (2, ["--tp", "2", "--sequence-parallel"] + DROPOUT),
    (4, ["--pp", "2", "--dp", "2", "--zero-stage", "3"] + DROPOUT),
], ids=["dp2-zero1-dropout", "pp2dp2-zero2-dropout", "tp2-sp-dropout", "pp2dp2-zero3-dropout"])
def test_exact_resume_20_straight_vs_10_plus_10(tmp_path, world, flags):
    args = TINY + flags + ["--train-iters", 20, "--save-interval", 10]
    _main(world, args + ["--save", tmp_path / "a", "--metrics-file", tmp_path / "a.jsonl"])
    resumable = args + ["--save", tmp_path / "b", "--load", tmp_path / "b", "--metrics-file", tmp_path / "b.jsonl"]
    _main(world, resumable, stop_after=10)                                # stops after iteration 10
    assert latest_iteration(tmp_path / "b") == 10
    _main(world, resumable)                                               # resumes at 11
    assert _records(tmp_path / "b.jsonl") == _records(tmp_path / "a.jsonl")  # bitwise: same floats
    assert len(_records(tmp_path / "a.jsonl")) == 20 + 4
    _assert_same_checkpoints(tmp_path / "a" / "iter_0000020", tmp_path / "b" / "iter_0000020")


CROSS = TINY + ["--train-iters", 20, "--global-batch-size", 16]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("serial") / "m.jsonl"
    _main(1, CROSS + ["--metrics-file", path])
    return read_metrics(path)


@pytest.fixture(scope="module")
def saved_tp2pp2dp2(tmp_path_factory, uninterrupted):
    d = tmp_path_factory.mktemp("tp2pp2dp2")
    _main(8, CROSS + ["--tp", 2, "--pp", 2, "--dp", 2, "--zero-stage", 1, "--save", d / "ck", "--save-interval", 10,
                      "--metrics-file", d / "m.jsonl"], stop_after=10)
    train, valid = read_metrics(d / "m.jsonl")
    assert_same_losses(train, uninterrupted[0][:10], "loss")
    return d / "ck"


@pytest.mark.slow                  # end to end through the launcher: the full suite only
@pytest.mark.parametrize("world,flags", [(8, ["--pp", 4, "--dp", 2, "--zero-stage", 2]), (1, ["--zero-stage", 3]),
                                         (4, ["--tp", 2, "--dp", 2, "--zero-stage", 3])],
                         ids=["tp1pp4dp2-zero2", "tp1pp1dp1-zero3", "tp2dp2-zero3"])
def test_resume_under_another_layout(saved_tp2pp2dp2, uninterrupted, tmp_path, world, flags):
    _main(world, CROSS + flags + ["--load", saved_tp2pp2dp2, "--metrics-file", tmp_path / "m.jsonl"])
    train, valid = read_metrics(tmp_path / "m.jsonl")
    assert_same_losses(train, uninterrupted[0][10:], "loss")
    assert_same_losses(valid, uninterrupted[1][2:], "valid_loss")


# 64 tokens = 4 samples of 16 tokens at a batch of 4, then 8: steps 1-2 at 4 (one micro-batch per rank at
# dp 2, two serially), steps 3-6 at 8; --global-batch-size 8 (TINY's) is the last batch, as a script gives it.
STEPPED = TINY + ["--step-batch-size-schedule", "0:4 128:8", "--train-iters", 6]


def test_a_batch_size_schedule_trains_as_serial_at_dp2_and_resumes_at_its_threshold_exactly(tmp_path):
    _main(1, STEPPED + ["--metrics-file", tmp_path / "serial.jsonl"])
    _main(2, STEPPED + ["--dp", 2, "--metrics-file", tmp_path / "a.jsonl"])
    serial, straight = read_metrics(tmp_path / "serial.jsonl")[0], read_metrics(tmp_path / "a.jsonl")[0]
    assert [r["global_batch_size"] for r in straight] == [4, 4, 8, 8, 8, 8]
    assert [r["consumed_samples"] for r in straight] == [4, 8, 16, 24, 32, 40]
    assert_same_losses(straight, serial, "loss")
    resumable = STEPPED + ["--dp", 2, "--save-interval", 2, "--save", tmp_path / "b", "--load", tmp_path / "b",
                           "--metrics-file", tmp_path / "b.jsonl"]
    _main(2, resumable, stop_after=2)                    # stops at the threshold: 8 samples consumed
    _main(2, resumable)                                  # resumes at a batch of 8
    assert _records(tmp_path / "b.jsonl") == _records(tmp_path / "a.jsonl")      # bitwise: same floats


@pytest.mark.slow                  # end to end through the launcher: the full suite only
def test_load_without_checkpoint_is_an_error(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *map(str, TINY), "--load", tmp_path / "none"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"--load {tmp_path / 'none'} does not exist" in run.stderr


_CRASH_ONCE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import megazero.training as training
    from megazero.cli import main as cli

    real_step, calls = training.train_step, []
    def train_step(chunks, micro_batches, topo, engine, job, **kw):
        out = real_step(chunks, micro_batches, topo, engine, job, **kw)
        calls.append(1)
        if topo.rank == 1 and len(calls) == 7 and not os.path.exists({marker!r}):
            open({marker!r}, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)        # a hard failure mid-training, after iteration 7
        return out
    training.train_step = train_step
    cli.exit_process(cli.run_program())   # as pretrain_gpt.py ends: groups gone, no teardown
""")


@pytest.mark.slow                  # end to end through the launcher: the full suite only
def test_torchrun_restart_after_a_killed_rank_resumes_from_the_checkpoint(tmp_path):
    script = tmp_path / "crash_once.py"
    script.write_text(_CRASH_ONCE.format(root=str(ROOT), marker=str(tmp_path / "crashed")))
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", str(script), *map(str, TINY), "--pp", "2", "--save", str(ck), "--load", str(ck), "--save-interval",
           "5", "--metrics-file", str(metrics)]
    # torch 2.13's launcher keeps one shared TCP store across restarts without a per-attempt key prefix,
    # so the restarted workers' gloo mesh reads the dead attempt's addresses ("Connection refused");
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh store hosted by its rank 0.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)                      # the launcher and every worker it started
        out, err = proc.communicate()
        pytest.fail(f"the restarted run did not finish in 360 s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    run = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert (tmp_path / "crashed").exists()
    assert "resumed from" in run.stdout and "at iteration 5" in run.stdout
    train, _ = read_metrics(metrics)
    iterations = [r["iteration"] for r in train]
    assert iterations.count(1) == 1 and iterations.count(6) == 2     # restarted from 5, not from scratch
    last = {r["iteration"]: r for r in train}                         # the records after the restart
    serial = tmp_path / "serial.jsonl"
    _main(1, TINY + ["--metrics-file", serial])
    assert_same_losses([last[i] for i in sorted(last)], read_metrics(serial)[0], "loss")


# ---------------------------------------------------------------- the schedule a resumed run keeps (in process)
FIRST = ["--mock-data", "--tp", "2", "--pp", "2", "--global-batch-size", "32", "--train-iters", "40", "--lr", "1.5e-4",
         "--lr-warmup-iters", "4"]
RESUMED = ["--mock-data", "--tp", "1", "--pp", "4", "--zero-stage", "2", "--lr", "1.5e-4", "--lr-warmup-iters", "4"]


@pytest.fixture
def saved_tp2pp2(tmp_path):
    """A checkpoint directory at iteration 40 of a tp2 pp2 run (global batch 32, 40 iterations) as far as
    a resume reads it before any process group: its tracker and the job its index stores."""
    job, _ = parse_job(FIRST, world_size=4)
    where = tmp_path / "ck"
    (where / fmt.iter_dir_name(40)).mkdir(parents=True)
    (where / fmt.iter_dir_name(40) / fmt.INDEX).write_text(json.dumps({"job": job.to_dict()}))
    (where / fmt.TRACKER).write_text("40")
    return where


def _resume(argv, capsys):
    """(job or None, stdout, stderr) of parsing a resumed run's flags at world size 4."""
    try:
        job, _ = parse_job(argv, world_size=4)
    except SystemExit as e:
        assert e.code == 2
        job = None
    out = capsys.readouterr()
    return job, out.out, out.err


def test_a_resume_that_changes_the_schedule_is_refused_naming_each_difference(saved_tp2pp2, capsys):
    job, _, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--train-iters", "60", "--lr", "3e-4"], capsys)
    assert job is None
    assert err.strip() == (
        f"pretrain_gpt.py: error: the checkpoint in {saved_tp2pp2} was trained with another schedule (--lr: checkpoint "
        f"0.00015 vs this run 0.0003; --lr-decay-iters: checkpoint 40 vs this run 60): add "
        f"--use-checkpoint-opt_param-scheduler to continue the checkpoint's, or --override-opt_param-scheduler to "
        f"train with this run's")
    job, _, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--global-batch-size", "64", "--train-iters", "40"],
                          capsys)
    assert job is None and "(--global-batch-size: checkpoint 32 vs this run 64)" in err
    job, _, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--step-batch-size-schedule", "0:32 1M:32",
                                     "--train-iters", "40"], capsys)     # the same last batch, grown in steps now
    assert job is None and "(--step-batch-size-schedule: checkpoint None vs this run 0:32 1M:32)" in err
    job, out, _ = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--step-batch-size-schedule", "0:32 1M:64",
                                     "--train-iters", "40", "--use-checkpoint-opt_param-scheduler"], capsys)
    assert (job.train.global_batch_size, job.train.step_batch_size_schedule, job.train.batch_schedule) == (32, None, None)
    assert f"--global-batch-size 32 taken from the checkpoint in {saved_tp2pp2} (kept by" in out


def test_without_a_global_batch_flag_the_checkpoints_is_taken_and_said(saved_tp2pp2, capsys):
    """The default (micro x dp x pp) follows the layout: 8 x 1 x 4 = 32 here would hide a change at another one."""
    job, out, _ = _resume(RESUMED + ["--pp", "2", "--load", str(saved_tp2pp2), "--train-iters", "40"], capsys)
    assert job.train.global_batch_size == 32 and job.num_micro_batches == 2
    assert f"--global-batch-size 32 taken from the checkpoint in {saved_tp2pp2} (no flag gives one)" in out
    job, _, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--train-iters", "40", "--micro-batch-size", "5"],
                          capsys)
    assert job is None and "is not divisible by --micro-batch-size 5" in err
    assert f"(32 is the global batch of the checkpoint in {saved_tp2pp2}, which this run continues: to train at " \
           f"another, give --global-batch-size with --override-opt_param-scheduler)" in err


def test_the_two_flags_keep_or_replace_the_checkpoints_schedule(saved_tp2pp2, capsys):
    longer = RESUMED + ["--load", str(saved_tp2pp2), "--train-iters", "60", "--lr", "3e-4"]
    job, out, _ = _resume(longer + ["--use-checkpoint-opt_param-scheduler"], capsys)
    assert (job.optimizer.lr, job.optimizer.lr_decay_iters, job.train.train_iters) == (1.5e-4, 40, 60)
    assert "--use-checkpoint-opt_param-scheduler: the schedule of the checkpoint in" in out
    job, out, _ = _resume(longer + ["--override-opt_param-scheduler"], capsys)
    assert (job.optimizer.lr, job.optimizer.lr_decay_iters, job.train.train_iters) == (3e-4, 60, 60)
    assert "--override-opt_param-scheduler: this run's schedule replaces the one of the checkpoint in" in out
    job, _, err = _resume(longer + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], capsys)
    assert job is None and "--use-checkpoint-opt_param-scheduler keeps the checkpoint's schedule and " \
                           "--override-opt_param-scheduler replaces it: keep one" in err


def test_a_layout_change_alone_is_accepted_silently(saved_tp2pp2, capsys):
    job, out, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--global-batch-size", "32", "--train-iters",
                                       "40"], capsys)
    assert job.train.global_batch_size == 32 and out == "" and err == ""


def test_a_checkpoint_older_than_a_schedule_setting_is_not_held_to_it(saved_tp2pp2, capsys):
    index = saved_tp2pp2 / fmt.iter_dir_name(40) / fmt.INDEX
    saved = json.loads(index.read_text())
    del saved["job"]["optimizer"]["lr_warmup_style"], saved["job"]["optimizer"]["weight_decay"]
    index.write_text(json.dumps(saved))
    job, out, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--global-batch-size", "32", "--train-iters", "40",
                                       "--weight-decay", "0.1"], capsys)
    assert job.optimizer.weight_decay == 0.1 and err == ""


def test_the_fp8_settings_are_no_mismatch_for_a_resume(saved_tp2pp2, capsys):
    """A bf16 checkpoint resumes in FP8 and an FP8 one without: only how the products are computed differs."""
    fp8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16"]
    job, out, err = _resume(RESUMED + fp8 + ["--load", str(saved_tp2pp2), "--global-batch-size", "32",
                                             "--train-iters", "40"], capsys)
    assert job.fp8.enabled and out == "" and err == ""
    index = saved_tp2pp2 / fmt.iter_dir_name(40) / fmt.INDEX
    saved = json.loads(index.read_text())
    saved["job"]["fp8"].update(fp8_format="e4m3", fp8_recipe="delayed", fp8_amax_history_len=1024)
    index.write_text(json.dumps(saved))
    job, out, err = _resume(RESUMED + ["--load", str(saved_tp2pp2), "--global-batch-size", "32", "--train-iters", "40"],
                            capsys)
    assert not job.fp8.enabled and out == "" and err == ""


FP8_DELAYED = ["--fp8-format", "e4m3", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]


@pytest.mark.slow                  # end to end through the launcher: the full suite only
def test_an_fp8_delayed_run_resumes_bitwise(tmp_path):
    """Through pretrain_gpt.py at dp2, ZeRO-1: 6 straight = 3 + stop + 3 (losses, evaluation, and every tensor of
    the last checkpoint, the amax histories included)."""
    args = TINY + FP8_DELAYED + ["--dp", 2, "--zero-stage", 1, "--train-iters", 6, "--save-interval", 3,
                                 "--eval-interval", 3, "--eval-iters", 1]
    _main(2, args + ["--save", tmp_path / "a", "--metrics-file", tmp_path / "a.jsonl"])
    resumable = args + ["--save", tmp_path / "b", "--load", tmp_path / "b", "--metrics-file", tmp_path / "b.jsonl"]
    _main(2, resumable, stop_after=3)
    assert latest_iteration(tmp_path / "b") == 3
    _main(2, resumable)
    assert _records(tmp_path / "b.jsonl") == _records(tmp_path / "a.jsonl")
    assert len(CheckpointReader(tmp_path / "a" / "iter_0000006").names("fp8.amax_history")) == 16
    _assert_same_checkpoints(tmp_path / "a" / "iter_0000006", tmp_path / "b" / "iter_0000006")


def test_a_resume_with_another_optimizer_is_refused_before_any_process_group(saved_tp2pp2, capsys):
    """The checkpoint's record of the optimizer that wrote its state (none: AdamW's, as before it existed)."""
    same = RESUMED + ["--load", str(saved_tp2pp2), "--global-batch-size", "32", "--train-iters", "40"]
    index = saved_tp2pp2 / fmt.iter_dir_name(40) / fmt.INDEX
    saved = json.loads(index.read_text())
    index.write_text(json.dumps({**saved, "optimizer": {"step": 40}}))
    job, _, err = _resume(same + ["--optimizer", "muon"], capsys)
    assert job is None and "holds adamw optimizer state but --optimizer is muon" in err
    index.write_text(json.dumps({**saved, "optimizer": {"name": "muon", "step": 40}}))
    job, _, err = _resume(same, capsys)
    assert job is None and err.strip() == (
        f"pretrain_gpt.py: error: the checkpoint in {saved_tp2pp2} holds muon optimizer state but --optimizer is "
        f"adamw (adamw keeps other state): give --optimizer muon to continue it, or add --no-load-optim to start "
        f"the adamw optimizer fresh from the checkpoint's weights")
    for flags in (["--optimizer", "dist_muon"], ["--no-load-optim"]):
        job, _, err = _resume(same + flags, capsys)
        assert job is not None and err == "", flags
