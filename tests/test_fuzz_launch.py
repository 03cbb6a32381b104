"""tools/fuzz/launch.py: forked ranks run pretrain_gpt.py's own program as torchrun's ranks do, and a
run that fails names each rank's own error lines."""
import time

import pytest
from helpers.trainer import TINY, read_metrics

from megazero.checkpoint.format import checkpoint_dir
from megazero.cli.launcher import SECONDHAND
from tools.fuzz.launch import GRACE_S, RunFailed, forked_launcher, program, torchrun_launcher

RUN = [*TINY, "--train-iters", "2", "--eval-iters", "0", "--dp", "2", "--zero-stage", "1", "--save", "ckpt",
       "--save-interval", "2", "--metrics-file", "metrics.jsonl"]


def test_forked_ranks_train_and_save_in_the_run_directory(tmp_path):
    forked_launcher(2, RUN, tmp_path)
    records, _ = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    assert checkpoint_dir(tmp_path / "ckpt", 2).is_dir()


@pytest.mark.slow
def test_forked_and_torchrun_ranks_give_the_same_numbers(tmp_path):
    for name, launch in (("forked", forked_launcher), ("torchrun", torchrun_launcher)):
        (tmp_path / name).mkdir()
        launch(2, RUN, tmp_path / name)
    forked, _ = read_metrics(tmp_path / "forked" / "metrics.jsonl")
    torchrun, _ = read_metrics(tmp_path / "torchrun" / "metrics.jsonl")
    assert [(r["loss"], r["grad_norm"]) for r in forked] == [(r["loss"], r["grad_norm"]) for r in torchrun]


def test_a_refused_flag_is_the_runs_error(tmp_path):
    with pytest.raises(RunFailed, match=r"rank 0 \(status 2\): pretrain_gpt.py: error: argument --zero-stage"):
        forked_launcher(2, ["--mock-data", "--zero-stage", "7"], tmp_path)


def test_a_rank_that_fails_alone_is_named_and_the_others_are_stopped(tmp_path, monkeypatch):
    from megazero.cli import run as build_step

    program()
    real = build_step.build_engine

    def build_engine(*args, **kwargs):           # forked ranks inherit this process's patch
        import os
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank 1 cannot build its engine")
        return real(*args, **kwargs)

    monkeypatch.setattr(build_step, "build_engine", build_engine)
    start = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        forked_launcher(2, RUN, tmp_path)
    message = str(failed.value)
    assert message.startswith("rank 1 exited with status 1")
    assert "rank 1 (status 1): Traceback" in message and "RuntimeError: rank 1 cannot build its engine" in message
    # rank 0 waited in a collective for rank 1: the launcher stopped it, or it saw the connection go first
    # (then it says so, and the report still names rank 1, which failed on its own)
    assert ("rank 0 (stopped by the launcher)" in message
            or f"rank 0 (status 1): pretrain_gpt.py: error: rank 0: {SECONDHAND}" in message)
    assert time.monotonic() - start < GRACE_S + 60
