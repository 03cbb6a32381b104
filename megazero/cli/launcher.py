"""A run's error line as the launcher reports it: the root cause in torchrun's failure report, and again as
the last line the user sees, after that report.

Under torchrun a worker that exits nonzero is followed by some 25 lines of the launcher's own report
(its traceback, a "Failures" block, "Root Cause"), which push the run's one-line error out of view.
:func:`report_to_launcher` does two things for the rank that says the line:

1. writes torchelastic's error file (``TORCHELASTIC_ERROR_FILE``), so the report's root cause is the
   line instead of "To enable traceback see ...";
2. leaves behind a small process of its own session, holding the worker's stderr, that waits for the
   launcher to exit and then prints the line once more: it comes after the launcher's report, on the
   terminal or in a pipe (``torchrun ... 2>&1 | tail -1`` shows it). It gives up after two minutes.

Outside torchrun (one process, or a launcher without torchelastic's environment) it does nothing: the
line printed by the caller is already the last one.

A refusal before any process group (a bad flag or file, which every rank finds alike) needs no report at
all: torch.distributed.elastic dresses every nonzero worker exit in some 40 lines (its SIGTERM notices, a
``ChildFailedError`` traceback, the failure report) and has no exit status it leaves plain. So under a
single-node torchrun rank 0, once it has said the line, ends the launch itself
(:func:`end_launch_after_refusal`): the launcher by ``SIGUSR1``, which it does not handle (it ends at
once, without a word; the job's status is 128 + 10 = 138), then the other workers. The line is then all
the job prints.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

# The waiter: poll the launcher's pid, then print the line (argv: launcher pid, line).
# An exited launcher whose parent has not reaped it yet (a program reading its output to the end first)
# is a zombie: it counts as gone.
_WAIT_THEN_PRINT = """
import os, sys, time
pid, line = int(sys.argv[1]), sys.argv[2]
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
deadline = time.monotonic() + 120
while time.monotonic() < deadline and alive():
    time.sleep(0.05)
time.sleep(0.05)
sys.stderr.write(line + "\\n")
"""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


# What a rank says when it stopped only because another rank stopped first (pretrain_gpt.py writes it;
# a launcher reading the ranks' output names another rank as the cause).
SECONDHAND = "lost the connection to another rank, which stopped first"


def report_to_launcher(line: str, message: str | None = None, secondhand: bool = False) -> None:
    """Make ``line`` (``prog: error: message``) the launcher's root cause and the last line printed.

    ``message`` (default ``line``) goes into the error file; ``secondhand`` (this rank stopped only
    because another did) dates it a second later, so the report's root cause is the rank that failed
    first, and prints nothing after the report (that rank's own line is the one that matters)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        text = message or line
        try:
            with open(error_file, "w") as f:
                when = str(int(time.time()) + int(secondhand))      # torchelastic's record() format
                json.dump({"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": when}}}, f)
        except OSError:
            pass                                       # the line printed by the caller is the report then
    if not under_torchrun() or secondhand:
        return
    try:
        subprocess.Popen([sys.executable, "-c", _WAIT_THEN_PRINT, str(os.getppid()), line],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                         close_fds=True, env={"PATH": os.environ.get("PATH", "")})
    except OSError:
        pass                                           # the line was printed once already


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                found.append(int(entry))
    return found


def _is_torchrun(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return False
    return any(w.endswith(b"torchrun") or w in (b"torch.distributed.run", b"torch.distributed.launch") for w in words)


def end_launch_after_refusal() -> bool:
    """End a single-node torchrun launch quietly once rank 0 has printed a refusal found before any process
    group: the launcher (this process's parent) by ``SIGUSR1``, then its other workers (those still
    waiting for this line, or past it in their own start) by ``SIGKILL``. Returns whether it did; it does
    nothing elsewhere (no torchrun, another rank, several nodes, whose launchers would lose their
    rendezvous instead, or a parent that is not torchrun), and the caller reports as usual."""
    if (not under_torchrun() or os.environ.get("RANK", "0") != "0" or not sys.platform.startswith("linux")
            or os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE")):
        return False
    launcher = os.getppid()
    if not _is_torchrun(launcher):
        return False
    others = [pid for pid in _children(launcher) if pid != os.getpid()]
    try:
        os.kill(launcher, signal.SIGUSR1)
    except OSError:
        return False
    for pid in others:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass                                       # already gone
    return True
