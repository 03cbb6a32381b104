"""How the fuzzer starts ``pretrain_gpt.py`` on ``world`` CPU ranks: forked from one warm parent, or torchrun.

    launch = LAUNCHERS["fork"]            # or "torchrun"
    launch(4, argv, Path("run-dir"))      # raises RunFailed (every failing rank's error lines) on failure

Both run the program a user runs: :func:`megazero.cli.run_program`, what ``pretrain_gpt.py`` runs (parse,
validate, build, train, save), each rank its own process with its own gloo process group set up from the environment
torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
They differ in who starts the processes:

- :func:`torchrun_launcher`: ``torchrun --standalone`` in a subprocess, fresh interpreters (the one-line
  commands a failing draw prints are these);
- :func:`forked_launcher` (the default on Linux): ``os.fork`` from the calling process, which imported torch,
  megazero and its program once. On the shared 2-core machine a fresh rank spent 2-14 s starting
  the interpreter and importing torch, 1-2 s more for megazero and 2-10 s for ``torch._dynamo`` (torch's
  reference ``normal_`` imports it when a 16-bit model initialises), and torchrun's agent several seconds
  starting and stopping: more than the run itself. A forked rank starts with all of that done.

A forked rank that fails is followed, as under torchrun, by stopping the others (SIGTERM, SIGKILL 10 s
later); its output goes to a file per rank, and the error names each rank's own lines.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from megazero.cli.launcher import SECONDHAND

ENTRY = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"

# launch(world, argv, cwd): run pretrain_gpt.py with argv on world ranks in cwd; raise RunFailed if it fails.
Launcher = Callable[[int, list, Path], None]

GRACE_S = 10.0          # after a rank fails, how long the others get to say their own line before SIGKILL


class RunFailed(RuntimeError):
    """A launched run exited with an error (its last lines are the message)."""


def own_lines(text: str) -> list[str]:
    """The lines a run wrote itself among a launcher's: the trainer's one-line errors, a traceback's
    frames and its last line (under torchrun they sit above the launcher's report)."""
    return [line for line in text.splitlines() if line.strip() and (
        "pretrain_gpt.py: error" in line or line.startswith(("Traceback", "  File"))
        or (line[:1].isalpha() and ("Error:" in line or "Exception:" in line)))]


def torchrun_launcher(world: int, argv: list, cwd: Path, timeout: float = 900) -> None:
    """``pretrain_gpt.py`` on ``world`` CPU processes (torchrun; one process runs it directly)."""
    launch = ([sys.executable] if world == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)])
    cmd = [*launch, str(ENTRY), *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if run.returncode != 0:
        text = run.stderr + run.stdout
        lines = [line for line in text.splitlines() if line.strip()]
        raise RunFailed(f"exit status {run.returncode}: " + "\n".join(own_lines(text)[-12:] + ["..."] + lines[-6:]))


def program():
    """The trainer's program (:mod:`megazero.cli`), imported once, with what its runs import lazily."""
    import torch._dynamo  # noqa: F401 - a 16-bit model's initialisation imports it (seconds per rank)

    from megazero.cli import main

    return main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_process(rank: int, world: int, port: int, argv: list[str], cwd: Path, log) -> None:
    """In a forked child: become rank ``rank`` as torchrun would start it, run the program, exit."""
    status = 70
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)          # and Python's streams onto them (a parent may have replaced its own)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)   # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)   # noqa: SIM115
        os.chdir(cwd)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        import torch

        torch.set_num_threads(1)
        pretrain = program()
        pretrain.exit_process(pretrain.run_program(argv))     # flushes, ends the groups, os._exit
    except BaseException:  # noqa: BLE001 - whatever happens, the child never returns into the parent's code
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _wait(pids: dict[int, int], statuses: dict[int, int], timeout: float) -> str:
    """Fill ``statuses`` with the exit status by rank (negative: the signal); return what stopped the run
    early, if anything (a rank's failure, the timeout)."""
    deadline, stopped, why = time.monotonic() + timeout, None, ""
    while len(statuses) < len(pids):
        for pid, rank in pids.items():
            if rank in statuses:
                continue
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[rank] = os.waitstatus_to_exitcode(code)
                if statuses[rank] != 0 and stopped is None:
                    stopped, why = time.monotonic(), f"rank {rank} exited with status {statuses[rank]}"
                    _signal(pids, statuses, signal.SIGTERM)
        if stopped is None and time.monotonic() > deadline:
            stopped, why = time.monotonic(), f"timed out after {timeout:.0f} s"
            _signal(pids, statuses, signal.SIGTERM)
        if stopped is not None and time.monotonic() > stopped + GRACE_S:
            _signal(pids, statuses, signal.SIGKILL)
        time.sleep(0.02)
    return why


def _signal(pids: dict[int, int], statuses: dict, sig: int) -> None:
    for pid, rank in pids.items():
        if rank not in statuses:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def forked_launcher(world: int, argv: list, cwd: Path, timeout: float = 900) -> None:
    """``pretrain_gpt.py`` on ``world`` CPU processes forked from this one (torch and the program imported
    once, here); each rank sets up its own gloo group from torchrun's environment variables."""
    program()
    port, argv = _free_port(), [str(a) for a in argv]
    logs = [tempfile.TemporaryFile() for _ in range(world)]
    pids: dict[int, int] = {}
    statuses: dict[int, int] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    # Frozen objects are out of the children's garbage collections: the program's collections at its end
    # (two full ones) would otherwise walk, and copy page by page, all this process holds (1-6 s a rank).
    gc.freeze()
    try:
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _rank_process(rank, world, port, argv, Path(cwd), logs[rank])
            pids[pid] = rank
        gc.unfreeze()
        why = _wait(pids, statuses, timeout)
        if why:
            raise RunFailed(_first_hand(why, logs, statuses) + ":\n" + _rank_errors(logs, statuses))
    finally:
        gc.unfreeze()
        for pid in [pid for pid, rank in pids.items() if rank not in statuses]:   # the parent was interrupted
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for log in logs:
            log.close()


def _first_hand(why: str, logs: list, statuses: dict[int, int]) -> str:
    """``why`` the run stopped, naming the rank that failed on its own: when a rank failed, the ranks
    talking to it fail too (a lost connection), and the launcher may see one of them exit first."""
    for rank, log in enumerate(logs):
        if statuses.get(rank, 0) > 0:
            log.seek(0)
            if SECONDHAND not in log.read().decode(errors="replace"):
                return f"rank {rank} exited with status {statuses[rank]}"
    return why


def _rank_errors(logs: list, statuses: dict[int, int]) -> str:
    """Each rank's exit status and its own error lines (the last few lines where it has none)."""
    out = []
    for rank, log in enumerate(logs):
        log.seek(0)
        text = log.read().decode(errors="replace")
        lines = own_lines(text) or [line for line in text.splitlines() if line.strip()][-3:]
        status = statuses.get(rank)
        said = ("stopped by the launcher" if status in (-signal.SIGTERM, -signal.SIGKILL) else f"status {status}")
        out.append(f"rank {rank} ({said}): " + ("\n  ".join(lines[-8:]) if lines else "(no output)"))
    return "\n".join(out)


LAUNCHERS: dict[str, Launcher] = {"fork": forked_launcher, "torchrun": torchrun_launcher}
# Forking after torch is imported is safe on Linux; macOS's system libraries are not fork-safe in threads' presence.
DEFAULT_LAUNCHER = "fork" if sys.platform.startswith("linux") else "torchrun"
LAUNCHER_HELP = (f"how each run's ranks start (default {DEFAULT_LAUNCHER}): fork, forked from this process with torch "
                 "and the trainer imported once (Linux); torchrun, fresh interpreters under torchrun, as the printed "
                 "commands start them")
