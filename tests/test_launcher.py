"""Under torchrun a refusal is the root cause of the launcher's report and the last line the user sees."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.trainer import ROOT


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_the_root_cause_and_the_last_line(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "pretrain_gpt.py"), "--mock-data", "--zero-stage", "7"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    line = "pretrain_gpt.py: error: argument --zero-stage: invalid choice: 7 (choose from 0, 1, 2, 3) (see --help)"
    assert run.returncode != 0 and lines[-1] == line, run.stderr[-2000:]
    assert "Root Cause" in run.stderr and "traceback : argument --zero-stage: invalid choice" in run.stderr
    assert "To enable traceback" not in run.stderr.split("Root Cause")[1]


def test_outside_torchrun_the_line_is_said_once(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", "--zero-stage", "7"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")})
    assert run.returncode == 2 and run.stderr.count("pretrain_gpt.py: error:") == 1, run.stderr
