"""Under torchrun a refusal before any process group is all the job prints, and the job ends nonzero."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.trainer import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("refused, line", [
    (["--tp", "3"], "pretrain_gpt.py: error: world size 2 is not divisible by tp*pp = 3*1 = 3: "),      # a flag
    (["--load", "missing"], "pretrain_gpt.py: error: --load missing does not exist: "),                   # a file
])
def test_a_refusal_under_torchrun_is_the_jobs_one_line(tmp_path, refused, line):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "pretrain_gpt.py"), "--mock-data", *refused]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = (run.stdout + run.stderr).splitlines()
    assert run.returncode != 0 and len(said) <= 5, run.stdout + run.stderr
    assert [s for s in said if s.startswith("pretrain_gpt.py: error:")] == [said[-1]], said
    assert said[-1].startswith(line) and "Traceback" not in run.stderr, said


def test_outside_torchrun_the_line_is_said_once(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", "--zero-stage", "7"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")})
    assert run.returncode == 2 and run.stderr.count("pretrain_gpt.py: error:") == 1, run.stderr


def test_a_refusal_only_another_rank_finds_names_that_rank(monkeypatch, capsys):
    """Rank 0 did not stop the launch in the wait (it found nothing wrong): rank 1 says its own line."""
    from megazero.cli import arguments

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(arguments.time, "sleep", lambda seconds: None)
    with pytest.raises(SystemExit) as stopped:
        arguments.stop_with("pretrain_gpt.py", ["--config run.yaml does not exist"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err == "pretrain_gpt.py: error: rank 1: --config run.yaml does not exist\n"


def test_a_lost_peer_is_said_to_have_died_silently_unless_it_counted_its_own_error(monkeypatch):
    """A rank SIGKILLed (out of memory) leaves no line: the rank that lost it must not point at one."""
    import torch.distributed as dist

    from megazero.cli import main

    store = dist.HashStore()
    monkeypatch.setattr(main.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(main.dist.distributed_c10d, "_get_default_store", lambda: store)
    assert main.what_the_other_rank_said().startswith("it died without an error message (killed by a signal")
    main.note_own_error()                                   # what a rank stopping with its own line does first
    assert main.what_the_other_rank_said() == "its error is the line above (and torchrun's root cause)"
