"""``--async-save`` end to end: the background save writes what a synchronous one writes (bitwise), even
while training changes the live tensors; a run resumed from it equals the uninterrupted run; a
SIGKILL during the background write leaves the previous checkpoint the latest and loadable; a failed
background write removes its temporary directory and stops the run with one line at the next wait; a
``--save`` directory deleted under the run is not written again. The writer is made slow or failing
inside the spawned processes only (a patched ``write_pieces``), never through the package."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import run_on_ranks
from helpers.trainer import ROOT, TINY, read_metrics

from megazero.checkpoint import latest_iteration
from megazero.checkpoint.format import TRACKER, recover
from megazero.checkpoint.offline import read_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
DP2 = ["--dp", "2", "--zero-stage", "1", "--train-iters", "4", "--save-interval", "2"]


def _slow_main_body(rank, world, argv, delay_s):
    """pretrain_gpt.main with every tensor file written ``delay_s`` late: the steps after a save run while
    its snapshot waits to be written (the live tensors change under it)."""
    import time

    import megazero.checkpoint.distributed as ckpt
    from megazero.cli import main as cli

    real = ckpt.write_pieces

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    ckpt.write_pieces = slow
    try:
        return cli.main(argv)
    finally:
        ckpt.write_pieces = real


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """The same tensor files and torch random states, bitwise; the same index but for the job's
    --async-save (Python's and NumPy's global random states are not seeded by the trainer)."""
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        if name.endswith(".safetensors"):
            assert fa[name] == fb[name], name
        elif name.startswith("rng/"):
            ra, rb = json.loads(fa[name]), json.loads(fb[name])
            assert {k: ra[k] for k in ("torch_cpu", "tp_trackers")} == {k: rb[k] for k in ("torch_cpu", "tp_trackers")}
    ia, ib = json.loads(fa["index.json"]), json.loads(fb["index.json"])
    for index in (ia, ib):
        index["job"]["checkpoint"].pop("async_save")
        index["job"]["checkpoint"].pop("save")
        index["job"]["checkpoint"].pop("load")
        index["job"]["logging"].pop("metrics_file")
    assert ia == ib


def _run(world, argv, delay_s=0.0):
    argv = [str(a) for a in argv]
    assert run_on_ranks(world, _slow_main_body, argv, delay_s, timeout=300) == [0] * world


def test_async_save_writes_the_sync_checkpoint_and_resumes_exactly(tmp_path):
    """dp2 ZeRO-1, saves at 2 and 4: sync vs async with every write 1.5 s late (steps 3-4 run while
    iteration 2's snapshot is written): the same checkpoints, bitwise. Resuming the async run's
    iteration 2 with --async-save gives the uninterrupted run's iteration 4, bitwise. Each save's
    blocked time is in the metrics file: iteration 2's far less than its write took."""
    sync, asyn, resumed = tmp_path / "sync", tmp_path / "async", tmp_path / "resumed"
    _run(2, TINY + DP2 + ["--save", sync, "--metrics-file", tmp_path / "sync.jsonl"])
    _run(2, TINY + DP2 + ["--save", asyn, "--async-save", "--metrics-file", tmp_path / "async.jsonl"], delay_s=1.5)
    for it in ("iter_0000002", "iter_0000004"):
        _assert_same_checkpoint(sync / it, asyn / it)
    records = [json.loads(line) for line in (tmp_path / "async.jsonl").read_text().splitlines()]
    blocked = {r["iteration"]: r["save_blocked_seconds"] for r in records if "save_blocked_seconds" in r}
    assert sorted(blocked) == [2, 4] and blocked[2] < 0.5, blocked      # 4 waits for 2's write: ~1.5 s
    assert [r["loss"] for r in read_metrics(tmp_path / "async.jsonl")[0]] == \
        [r["loss"] for r in read_metrics(tmp_path / "sync.jsonl")[0]]

    shutil.copytree(asyn, resumed, ignore=shutil.ignore_patterns("iter_0000004"))
    (resumed / TRACKER).write_text("2\n")
    _run(2, TINY + DP2 + ["--save", resumed, "--load", resumed, "--async-save"])
    _assert_same_checkpoint(sync / "iter_0000004", resumed / "iter_0000004")


# A single-process run whose background writes misbehave as the test says (argv[1]): "pause-shard" and
# "pause-tracker" stop the second save's thread (before its tensor file, before the tracker moves) and
# say PAUSED; "fail" makes the first save's tensor file fail.
_SCRIPT = textwrap.dedent("""
    import runpy, sys, time
    import megazero.checkpoint.distributed as ckpt
    import megazero.checkpoint.format as fmt
    mode, calls = sys.argv[1], dict(write=0, tracker=0)
    real_write, real_tracker = ckpt.write_pieces, fmt.replace_tracker
    def pause():
        print("PAUSED", flush=True)
        time.sleep(60)
    def write(*a, **k):
        calls["write"] += 1
        if mode == "fail":
            raise OSError(28, "No space left on device (a test)")
        if mode == "pause-shard" and calls["write"] == 2:
            pause()
        return real_write(*a, **k)
    def tracker(*a, **k):
        calls["tracker"] += 1
        if mode == "pause-tracker" and calls["tracker"] == 2:
            pause()
        return real_tracker(*a, **k)
    ckpt.write_pieces, fmt.replace_tracker = write, tracker
    sys.argv = [{main!r}] + sys.argv[2:]
    runpy.run_path({main!r}, run_name="__main__")
""").format(main=str(ROOT / "pretrain_gpt.py"))


def _start(mode: str, *flags, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, mode, *TINY, *flags], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def _read_until(proc: subprocess.Popen, text: str) -> None:
    line = proc.stdout.readline()
    while line and text not in line:
        line = proc.stdout.readline()
    assert text in line, f"no {text!r} in the output; stderr: {proc.stderr.read()[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pause-shard", "pause-tracker"])
def test_sigkill_during_a_background_write_keeps_the_previous_latest(mode, tmp_path):
    """Saves every 2 iterations, in the background; the second one's thread is held (twice per window,
    the second kill half a second later, training going on meanwhile) and the process SIGKILLed: iteration 2 stays the
    latest and reads back whole; the next run tidies the directory and resumes from it."""
    save = tmp_path / "run"
    for attempt in range(2):
        shutil.rmtree(save, ignore_errors=True)
        proc = _start(mode, "--train-iters", "1000", "--save", save, "--save-interval", "2", "--async-save",
                      cwd=tmp_path)
        try:
            _read_until(proc, "PAUSED")
            time.sleep(0.5 * attempt)               # training goes on while the thread is held
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        assert latest_iteration(save) == 2
        cfg, tensors, index = read_model(save)      # complete, every file's checksum verified
        assert index["iteration"] == 2 and tensors
        if mode == "pause-shard":
            assert (save / ".iter_0000004.tmp").is_dir() and not (save / "iter_0000004").exists()
        else:                                       # renamed into place, not yet the latest
            assert (save / "iter_0000004" / "manifest.json").is_file()
    assert recover(save) == (["removed the half-written .iter_0000004.tmp"] if mode == "pause-shard" else [])
    resumed = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", "3",
                              "--save", str(save), "--load", str(save), "--async-save",
                              "--override-opt_param-scheduler", "--metrics-file", str(tmp_path / "m.jsonl")],
                             cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["iteration"] for r in read_metrics(tmp_path / "m.jsonl")[0]] == [3]
    assert latest_iteration(save) == 3


def test_a_failed_background_write_stops_the_run_with_one_line(tmp_path):
    """The first background save fails (no space): the run stops at the next wait, nonzero, with one
    line naming the checkpoint and the error; no checkpoint becomes the latest."""
    save = tmp_path / "run"
    proc = _start("fail", "--train-iters", "6", "--save", save, "--save-interval", "2", "--async-save",
                  cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (f"pretrain_gpt.py: error: the background save of {save}/iter_0000002 failed: No space left on "
                    f"device (a test) (free space there or save elsewhere); the half-written .iter_0000002.tmp was "
                    f"removed and the previous checkpoint, if any, stays the latest"), last
    assert "saving checkpoint" in out and " iteration      3/6" in out      # training went on meanwhile
    assert latest_iteration(save) is None and sorted(p.name for p in save.iterdir()) == [".lock"]


@pytest.mark.slow
def test_ten_sigkills_at_random_moments_of_background_saves_always_leave_a_loadable_latest(tmp_path):
    """Saves every iteration in the background, at a model whose files take a while to write; the process
    is SIGKILLed at a random moment (seeded) after its first background save committed, ten times: each time
    the latest checkpoint reads back whole (every checksum) at an iteration the run reached, and the
    directory holds nothing a restart cannot tidy. Two runs at a time (each its own directory), as the
    machine's two cores allow."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    wide = ["--hidden-size", "256", "--num-layers", "4", "--vocab-size", "4096"]
    pick = random.Random(1234)
    delays = [pick.uniform(0.0, 1.5) for _ in range(10)]

    def kill_and_check(kill: int) -> None:
        save = tmp_path / f"run{kill}"
        proc = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, *wide, "--train-iters", "1000",
                                 "--save", str(save), "--save-interval", "1", "--async-save"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            _read_until(proc, "written in the background")   # the first background save committed
            time.sleep(delays[kill])
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        latest = latest_iteration(save)
        _, tensors, index = read_model(save)        # complete, every file's checksum verified
        assert index["iteration"] == latest and tensors, kill
        recover(save)
        assert not list(save.glob(".*.tmp")), kill

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(kill_and_check, range(10)))              # raises the first run's failure


def _one_piece_plan(save_dir: Path, iteration: int):
    """A one-piece, one-rank save plan (host tensors): what the background thread writes, without a model."""
    import torch

    from megazero.checkpoint.distributed import SavePlan
    from megazero.checkpoint.format import iter_dir_name

    piece = ("model/w", [4], [[0, 4]], (0, 4), torch.arange(4.0) + iteration)
    return SavePlan(save_dir, save_dir / iter_dir_name(iteration), 0, 1, [piece], {}, {"iteration": iteration,
                                                                                        "tensors": {}})


def test_a_background_save_that_fails_midway_leaves_no_temporary(tmp_path, monkeypatch):
    """In-process: a background write refused after part of its files (no space) removes its
    ``.iter_*.tmp``; the wait says what failed; the earlier checkpoint stays the latest, whole."""
    import megazero.checkpoint.distributed as distributed
    from megazero.checkpoint.async_save import AsyncCheckpointWriter
    from megazero.errors import CheckpointError

    save, writer = tmp_path / "run", AsyncCheckpointWriter()
    writer.start(_one_piece_plan(save, 2))
    writer.wait()
    before = _files(save / "iter_0000002")
    real = distributed.write_pieces

    def fills_the_disk(path, *args, **kwargs):
        real(path, *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(distributed, "write_pieces", fills_the_disk)
    writer.start(_one_piece_plan(save, 4))
    with pytest.raises(CheckpointError) as e:
        writer.wait()
    assert str(e.value) == (f"the background save of {save}/iter_0000004 failed: No space left on device (free "
                            f"space there or save elsewhere); the half-written .iter_0000004.tmp was removed and "
                            f"the previous checkpoint, if any, stays the latest")
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert latest_iteration(save) == 2 and _files(save / "iter_0000002") == before


def test_a_background_save_into_a_deleted_save_directory_writes_nothing(tmp_path):
    """In-process: ``--save`` deleted while the run holds its lock: the next background save does not
    make the directory again, and the wait stops the run with one line naming ``--save``."""
    from megazero.checkpoint.async_save import AsyncCheckpointWriter
    from megazero.checkpoint.lock import SaveLock
    from megazero.errors import CheckpointError

    save = tmp_path / "run"
    lock = SaveLock.acquire(save)
    writer = AsyncCheckpointWriter(lock=lock)
    writer.start(_one_piece_plan(save, 2))
    writer.wait()
    shutil.rmtree(save)
    writer.start(_one_piece_plan(save, 4))
    with pytest.raises(CheckpointError) as e:
        writer.wait()
    assert str(e.value).startswith(f"the background save of {save}/iter_0000004 failed: --save {save} was deleted "
                                   f"while this run was using it: iter_0000004 is not written there"), str(e.value)
    assert not save.exists()
    lock.release()
