"""Faults found only while running, through the real entry point in real processes: a diverging
run stops without saving its bad state; a stopped rank ends the job after the distributed timeout
instead of hanging; killing the launcher ends its workers and frees ``--save`` for the next run,
which a second run could not take while the first was alive; a ``--save`` deleted under a running run
stops it at its next save, writing nothing; a run that ends releases the lock, leaving nothing to
take over; a run refused before it starts leaves ``--save`` untouched.

Inputs known at start are refused by ``test_bad_input.py``.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.trainer import ROOT, TINY, read_metrics

from megazero.checkpoint.format import TRACKER
from megazero.checkpoint.reader import CheckpointReader

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FOREVER = ["--train-iters", "100000", "--eval-interval", "100000"]   # runs until the test ends it


def _pretrain(*flags, cwd):
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *flags], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=ENV)


def _launch(nproc: int, *flags, cwd) -> subprocess.Popen:
    """torchrun in a process group (session) of its own, as a cluster scheduler would start it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "pretrain_gpt.py"), *flags]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)


def _wait_for(predicate, what: str, limit_s: float = 240) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < limit_s, f"waited {limit_s} s for {what}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """The launcher's workers: processes whose parent is ``pid``, in start order."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


def _end(proc: subprocess.Popen, pids=()) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


# Which of the two goes non-finite first depends on the CPU's kernels (a loss of 4e12 beside a nan
# gradient norm on one machine, both nan on another): either stops the run.
NONFINITE = r"loss (?P<loss>[-+.\w]+), gradient norm (?P<norm>[-+.\w]+)"
# fp16: step 1 (lr 5e5 in warmup) is finite and applied, and its fp32 masters no longer fit in fp16
OVERFLOWED = r"(?P<param>\S+) \(fp16 weights, rank 0\) is not finite after the step was applied"


def _assert_latest_is_finite(save: Path, want: int | None) -> None:
    """The latest checkpoint under ``save`` is ``want`` (None: there is none), reads back whole (every
    block's checksum) and holds only finite tensors, whatever their kind and precision."""
    if want is None:
        assert not (save / TRACKER).exists() and not any(p.name.startswith("iter_") for p in save.iterdir())
        return
    assert int((save / TRACKER).read_text()) == want
    assert max(p.name for p in save.iterdir() if p.name.startswith("iter_")) == f"iter_{want:07d}"
    reader = CheckpointReader(save / f"iter_{want:07d}")
    assert reader.tensors
    for key in reader.tensors:
        assert bool(reader.read_full(key).isfinite().all()), key


@pytest.mark.parametrize("precision,reason", [
    ([], NONFINITE + r" \(first non-finite gradients: \S+"),
    pytest.param(["--bf16"], NONFINITE, marks=pytest.mark.slow),
    pytest.param(["--fp16"], OVERFLOWED, marks=pytest.mark.slow),
], ids=["fp32", "bf16", "fp16"])
def test_a_diverging_run_stops_and_keeps_only_finite_checkpoints(precision, reason, tmp_path):
    """lr 1e6: the first steps (lr 5e5 in warmup) wreck the weights. fp32/bf16: at iteration N a loss or
    gradient is not finite; the step is not applied. fp16: the first step's fp16 weights overflow
    while its masters are finite, found right after the step. The run stops nonzero at that iteration
    with one line, logs it, saves nothing of it: with --save-interval 1 the latest checkpoint is N - 1,
    finite in every tensor; with only the end-of-run save there is none."""
    for interval in (["--save-interval", "1"], []):
        save, metrics = tmp_path / f"run{len(interval)}", tmp_path / f"m{len(interval)}.jsonl"
        run = _pretrain(*TINY, *precision, "--lr", "1e6", "--save", str(save), *interval,
                        "--metrics-file", str(metrics), cwd=tmp_path)
        last = run.stderr.strip().splitlines()[-1]
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
        found = re.fullmatch(rf"pretrain_gpt.py: error: iteration (\d+): .*{reason}.*", last)
        assert found, last
        stopped = int(found.group(1))
        train = read_metrics(metrics)[0]
        assert train[-1]["iteration"] == stopped                # the fatal step is in the record
        if "--fp16" in precision:
            assert stopped == 1 and math.isfinite(train[-1]["loss"]) and not train[-1]["skipped"]
            assert "use --bf16" in last
        else:                                               # JSON has no nan: a non-finite figure is null
            assert {found["loss"], found["norm"]} & {"nan", "inf", "-inf"}, last
            assert 1 < stopped < 10
            assert not all(math.isfinite(train[-1][k] or math.nan) for k in ("loss", "grad_norm"))
        _assert_latest_is_finite(save, stopped - 1 if interval and stopped > 1 else None)


@pytest.mark.slow
def test_fp16_skipped_steps_are_named_by_iteration_and_stop_the_run(tmp_path):
    """A loss scale of 1e30 overflows every fp16 gradient: each skip names its own iteration and the
    precision, --max-consecutive-skipped-steps 3 stops the run at iteration 3, and no save lands on a
    skipped step (the weights are those of the start: nothing to save)."""
    save, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    run = _pretrain(*TINY, "--fp16", "--initial-loss-scale", "1e30", "--hysteresis", "1",
                    "--max-consecutive-skipped-steps", "3", "--save", str(save), "--save-interval", "1",
                    "--metrics-file", str(metrics), cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.fullmatch(r"pretrain_gpt.py: error: iteration 3: 3 steps skipped in a row .*",
                        run.stderr.strip().splitlines()[-1])
    for i in (1, 2, 3):
        assert f"iteration {i}: fp16 gradients overflowed (inf/nan): step skipped" in run.stderr, run.stderr
    assert [r["skipped"] for r in read_metrics(metrics)[0]] == [True] * 3
    _assert_latest_is_finite(save, None)


def test_an_fp32_skipped_step_says_its_gradients_were_not_finite(tmp_path):
    """With the non-finite check off, an fp32 run skips the steps whose gradients are not finite and
    says so in those words (not fp16's loss-scale message), until --max-consecutive-skipped-steps."""
    run = _pretrain(*TINY, "--lr", "1e6", "--no-check-for-nan-in-loss-and-grad", "--max-consecutive-skipped-steps",
                    "2", cwd=tmp_path)
    assert run.returncode == 1 and "steps skipped in a row" in run.stderr, run.stderr[-3000:]
    assert "step skipped: non-finite gradients (fp32)" in run.stdout, run.stdout[-3000:]
    assert "fp16" not in run.stdout


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    """A 4-rank tp2 job, one rank frozen with SIGSTOP: its tensor-parallel partner's collective times
    out after --distributed-timeout-minutes 0.25 (15 s: long past a tiny step, short for the test), the
    other ranks end, and the job ends nonzero naming the timeout. Once the others have ended the frozen
    rank is continued, so it takes torchrun's SIGTERM at once: torchrun would otherwise wait its fixed
    30 s grace before killing a stopped worker (its own behaviour, which --shutdown-timeout does not
    shorten for a worker that failed)."""
    metrics = tmp_path / "m.jsonl"
    timeout_s = 15
    job = _launch(4, *TINY, *FOREVER, "--tp", "2", "--distributed-timeout-minutes", f"{timeout_s / 60:g}",
                  "--metrics-file", str(metrics), cwd=tmp_path)
    workers = []
    try:
        _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, "the first iteration")
        workers = _children(job.pid)
        assert len(workers) == 4, workers
        frozen, others = workers[-1], workers[:-1]      # the last local rank: rank 0 stays to report
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        _wait_for(lambda: not any(_alive(w) for w in others), "the other ranks to end", limit_s=timeout_s + 90)
        others_ended = time.monotonic() - t0
        os.kill(frozen, signal.SIGCONT)
        out, _ = job.communicate(timeout=120)
        ended = time.monotonic() - t0
    finally:
        _end(job, workers)
    assert job.returncode != 0
    assert f"did not complete within --distributed-timeout-minutes {timeout_s / 60:g}" in out, out[-3000:]
    assert others_ended < timeout_s + 60, others_ended
    print(f"stopped rank: the other ranks ended {others_ended:.0f} s after SIGSTOP, the job {ended:.0f} s "
          f"(timeout {timeout_s} s)")


@pytest.mark.slow
def test_killing_the_launcher_ends_the_workers_and_frees_the_save_lock(tmp_path):
    """While a 2-rank job saves into --save, a second run on it is refused; SIGKILL to the launcher's
    process group ends both workers within 10 s; a third run then takes the lock over and resumes."""
    save, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    job = _launch(2, *TINY, *FOREVER, "--dp", "2", "--save", str(save), "--load", str(save), "--save-interval", "1",
                  "--metrics-file", str(metrics), cwd=tmp_path)
    workers = []
    try:
        _wait_for(lambda: (save / TRACKER).exists(), "the first checkpoint")
        workers = _children(job.pid)
        assert len(workers) == 2, workers
        second = _pretrain(*TINY, *FOREVER, "--save", str(save), "--load", str(save), cwd=tmp_path)   # the same run
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"--save {save} is in use by another run (pid" in second.stderr.strip().splitlines()[-1]
        os.killpg(job.pid, signal.SIGKILL)          # the launcher's group; torchrun's workers have their own
        t0 = time.monotonic()
        _wait_for(lambda: not any(_alive(w) for w in workers), "the workers to end", limit_s=10)
        print(f"workers ended {time.monotonic() - t0:.1f} s after the launcher was killed")
    finally:
        _end(job, workers)
    done = int((save / TRACKER).read_text())
    third = _pretrain(*TINY, "--train-iters", str(done + 1), "--save", str(save), "--load", str(save),
                      "--override-opt_param-scheduler",
                      "--metrics-file", str(tmp_path / "third.jsonl"), cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "took over the lock" in third.stdout and "left by a run that has ended" in third.stdout
    assert [r["iteration"] for r in read_metrics(tmp_path / "third.jsonl")[0]] == [done + 1]
    assert json.loads((save / f"iter_{done + 1:07d}" / "index.json").read_text())["iteration"] == done + 1


@pytest.mark.slow
def test_a_rank_that_fails_alone_is_the_one_line_and_the_root_cause(tmp_path):
    """Resuming at dp 2 from a checkpoint whose rng/rank00001.json is damaged: only rank 1 reads that
    file. Its line, naming the file, is what the job prints (by rank 0, which agrees on the error
    instead of losing its peer mid-collective) and torchrun's failure report shows as the cause; no
    rank prints a traceback or dies by an uncaught C++ exception."""
    small = [*TINY, "--global-batch-size", "4", "--eval-iters", "0"]
    save = tmp_path / "run"
    first = _launch(2, *small, "--train-iters", "2", "--save", str(save), cwd=tmp_path)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    damaged = save / "iter_0000002" / "rng" / "rank00001.json"
    damaged.write_text("{ damaged")
    second = _launch(2, *small, "--train-iters", "4", "--load", str(save), "--save", str(save),
                     "--override-opt_param-scheduler", cwd=tmp_path)
    out, _ = second.communicate(timeout=300)
    assert second.returncode != 0, out[-3000:]
    line = f"rank 1: checkpoint file {damaged} has 9 bytes, the manifest says"
    ours = [s for s in out.splitlines() if s.startswith("pretrain_gpt.py: error:")]
    assert len(ours) == 2 and all(line in s for s in ours), out[-3000:]       # said, and again after the report
    assert [s for s in out.splitlines() if s.strip()][-1] == ours[0], out[-3000:]
    report = out[out.index("Root Cause"):]
    assert f"traceback : {line}" in report, out[-3000:]
    assert "terminate called" not in out and "Connection closed by peer" not in out, out[-3000:]
    assert out.count("Traceback") == 1 and "ChildFailedError" in out, out[-3000:]   # torchrun's, about the workers
    assert int((save / TRACKER).read_text()) == 2                        # nothing was saved over it


def _save_fills_the_disk(rank, world, argv):
    """The trainer, with every checkpoint write on rank ``world - 1`` failing as a full disk would:
    (exit status, what the rank wrote to stderr)."""
    import contextlib
    import errno
    import io

    import megazero.checkpoint.distributed as distributed
    from megazero.cli import main as cli

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real, err = distributed.write_pieces, io.StringIO()
    if rank == world - 1:
        distributed.write_pieces = full
    try:
        with contextlib.redirect_stderr(err):
            return cli.main(argv), err.getvalue()
    except SystemExit as e:
        return e.code, err.getvalue()
    finally:
        distributed.write_pieces = real                  # the worker serves later tests


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_tmp(world, tmp_path):
    """``No space left on device`` while writing a checkpoint: status 1, one line naming the checkpoint
    and the fix, the half-written ``.iter_*.tmp`` removed, the previous checkpoint still the latest."""
    from helpers import run_on_ranks

    save = tmp_path / "run"
    argv = [*TINY, "--global-batch-size", "4", "--eval-iters", "0", "--train-iters", "2", "--save", str(save),
            "--save-interval", "1"]
    results = run_on_ranks(world, _save_fills_the_disk, argv, timeout=300)
    assert [code for code, _ in results] == [1] * world
    err = "".join(text for _, text in results)
    assert "Traceback" not in err
    last = [s for s in err.splitlines() if s.startswith("pretrain_gpt.py: error:")]
    prefix = f"rank {world - 1}: " if world > 1 else ""
    assert len(last) == 1 and f"{prefix}writing {save / 'iter_0000001'} failed: No space left on device (free space" \
        in last[0], err
    assert not list(save.glob(".iter_*")) and not (save / TRACKER).exists()
    assert (save / ".lock").read_text() == ""          # released at the end: the next run takes nothing over


@pytest.mark.parametrize("mode", [[], ["--async-save"]])
def test_a_save_directory_deleted_under_a_run_stops_it_writing_nothing(mode, tmp_path):
    """``--save`` deleted while a run saves into it every iteration (synchronously or in the background):
    the run stops at its next save, status 1, with one line naming ``--save`` and what happened, and does
    not make the directory again (a second run could otherwise lock it and lose checkpoints to this one)."""
    save = tmp_path / "run"
    run = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, *FOREVER, "--eval-iters", "0",
                            "--save", str(save), "--save-interval", "1", *mode], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        _wait_for(lambda: (save / TRACKER).exists(), "the first checkpoint")
        while save.exists():                         # the run may be writing into it meanwhile
            shutil.rmtree(save, ignore_errors=True)
        _, err = run.communicate(timeout=120)
    finally:
        _end(run)
    assert run.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(rf"pretrain_gpt.py: error: (the background save of {re.escape(str(save))}/iter_\d+ failed: )?"
                    rf"--save {re.escape(str(save))} "
                    rf"(was deleted while this run was using it|lost its .lock while this run was using it|is being "
                    rf"deleted while this run uses it \(\S+ vanished as it was written\)): iter_\d+ is not written "
                    rf"there and the run stops", last), last
    assert not save.exists()


@pytest.mark.parametrize("refusal", ["tensorboard", "memory budget"])
def test_a_refused_run_leaves_its_save_directory_untouched(refusal, tmp_path, monkeypatch, capsys):
    """A run refused for a missing optional package (``--tensorboard-dir`` without tensorboard) or a
    memory budget nothing meets stops with status 2 before taking ``--save``'s lock: a directory that
    did not exist is not made, no ``.lock`` is left."""
    import importlib.util

    from megazero.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args, **kwargs: None if name == "tensorboard" else real(name, *args, **kwargs))
    flags = {"tensorboard": ["--tensorboard-dir", str(tmp_path / "tb")],
             "memory budget": ["--memory-budget-gib", "0.0001"]}[refusal]
    save = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        main([*TINY, "--save", str(save), *flags])
    assert stopped.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("pretrain_gpt.py: error: " + {"tensorboard": "--tensorboard-dir needs the tensorboard "
                                                         "package, which is not installed",
                                                         "memory budget": "no recompute or offload plan fits"}[refusal])
    assert not save.exists() and not (tmp_path / "tb").exists()
