"""One run per ``--save`` directory: an exclusive lock held by rank 0 for the life of the run.

Two runs writing the same checkpoints (a restarted job whose orphaned workers still run, two jobs
given the same path) would overwrite each other's files. The lock is ``flock`` on ``DIR/.lock``:
the system releases it when its holder dies however it dies, so a lock left by a crashed run is
simply taken over (the file names the previous holder, and the take-over says so).
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from megazero.config import FLAG
from megazero.errors import CheckpointError

LOCK = ".lock"


class SaveLock:
    """Held while the object lives (or until :meth:`release`)."""

    def __init__(self, fd: int, path: Path, previous: str):
        self.fd, self.path, self.previous = fd, path, previous

    @classmethod
    def acquire(cls, save_dir: str | os.PathLike) -> "SaveLock":
        """Take the lock of ``save_dir`` (created if needed) or raise naming the run that holds it."""
        path = Path(save_dir) / LOCK
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(f"{FLAG.save} {save_dir} is in use by another run ({holder}): wait for it to end, or "
                                  f"save this run elsewhere") from None
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        return cls(fd, path, previous)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.release()
