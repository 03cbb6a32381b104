"""A real multi-node launch on one machine: two torchrun agents (``--nnodes 2``, a c10d rendezvous on
127.0.0.1, 4 processes each) train pretrain_gpt.py with tp 2 x dp 4 and ZeRO-3 and log the same
losses as one node of 8 processes; with ZeRO++'s three switches on, the two agents (4 ranks per
node from torchrun's LOCAL_WORLD_SIZE) match the one node told ``--ranks-per-node 4``. The one node is
the tests' pool of 8 gloo processes running the trainer's main, started once per session (a torchrun
launch of 8 fresh processes spends most of its time importing torch on 2 cores)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from helpers import run_on_ranks
from helpers.trainer import ROOT, TINY, main_body, read_metrics

LAYOUT = ["--tp", "2", "--zero-stage", "3", "--train-iters", "6", "--eval-interval", "6", "--eval-iters", "1"]
ZEROPP = ["--zero-quantized-weights", "--zero-hpz-partition-size", "2", "--zero-quantized-gradients",
          "--zero-quantization-block-size", "32"]
TIMEOUT = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(launch: list[str], flags: list[str], metrics) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, str(ROOT / "pretrain_gpt.py"), *TINY,
            *LAYOUT, *flags, "--metrics-file", str(metrics)]


def _finish(procs: dict[str, subprocess.Popen]) -> None:
    """Wait for every launcher; on any failure or timeout, stop the rest and show every one's output."""
    outputs, failed = {}, False
    for name, p in procs.items():
        try:
            outputs[name] = p.communicate(timeout=TIMEOUT)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            outputs[name] = p.communicate()[0] + f"\n[{name}: killed after {TIMEOUT}s]"
            failed = True
        failed = failed or p.returncode != 0
    if failed:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        shown = "\n".join(f"===== {name} (exit {procs[name].returncode}) =====\n{_first_errors(out)}{out[-4000:]}"
                          for name, out in outputs.items())
        pytest.fail(f"a launcher failed:\n{shown}")


def _first_errors(out: str) -> str:
    """The lines that say why a rank died (the launcher's own report, at the end, only names the signal)."""
    keys = ("terminate called", "what():", "Error", "error", "Traceback", "corrupt", "Signal")
    lines = [line for line in out.splitlines() if any(k in line for k in keys)][:40]
    return ("first error lines:\n" + "\n".join(lines) + "\n----- tail -----\n") if lines else ""


def _run(tmp_path, name: str, flags: list[str], two_agents: bool) -> list[float]:
    """The losses of the run ``name``: two torchrun agents of 4 processes, or one node of 8 (the pool)."""
    metrics = tmp_path / f"{name}.jsonl"
    if two_agents:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        port = _free_port()
        rdzv = ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name]
        procs = {f"agent {k}": subprocess.Popen(_launcher([*rdzv, "--node-rank", str(k)], flags, metrics),
                                                cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT) for k in (0, 1)}
        _finish(procs)
    else:
        argv = [*TINY, *LAYOUT, *flags, "--metrics-file", str(metrics)]
        assert run_on_ranks(8, main_body, argv, timeout=TIMEOUT) == [0] * 8
    return [r["loss"] for r in read_metrics(metrics)[0]]


@pytest.mark.slow
def test_two_agents_match_one_agent(tmp_path):
    two = _run(tmp_path, "two-zero3", [], True)
    one = _run(tmp_path, "one-zero3", [], False)
    assert len(two) == 6 and two == one
    two_pp = _run(tmp_path, "two-zeropp", ZEROPP, True)
    one_pp = _run(tmp_path, "one-zeropp", [*ZEROPP, "--ranks-per-node", "4"], False)
    assert two_pp == one_pp and two_pp != two
    assert max(abs(a - b) / b for a, b in zip(two_pp, two)) < 0.02
