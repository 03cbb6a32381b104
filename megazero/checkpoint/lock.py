"""One run per ``--save`` directory: an exclusive lock held by rank 0 for the life of the run.

Two runs writing the same checkpoints (a restarted job whose orphaned workers still run, two jobs
given the same path) would overwrite each other's files. The lock is ``flock`` on ``DIR/.lock``,
whose text names the holder. The system releases it when its holder dies however it dies, so a lock
left by a crashed run is simply taken over (its text still names that run, and the take-over says
so); a run that ends cleanly clears the text as it releases the lock, so the next run says nothing.

A lock is held by an open file, not by a path: the directory (or its ``.lock``) deleted or replaced
under a running run leaves the run holding a lock nobody else sees, and a second run could lock the
new directory. So before each save is written, and again before it is committed, the saver checks
that ``DIR/.lock`` is still the file it holds (:meth:`SaveLock.check`), and stops the run, writing
nothing, when it is not.
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


class SaveDirectoryLost(CheckpointError):
    """``--save`` (or its lock file) was deleted or replaced under the running run: nothing there is
    this run's to write or tidy any more."""


def directory_lost(save_dir: str | os.PathLike, what: str, checkpoint: str) -> SaveDirectoryLost:
    """The one line of a run that stops because ``--save`` ``what`` (``was deleted while ...``) before
    ``checkpoint`` was written."""
    return SaveDirectoryLost(f"{FLAG.save} {save_dir} {what}: {checkpoint} is not written there and the run stops; "
                             f"start again with another {FLAG.save} directory (or put this one back and resume it "
                             f"with {FLAG.load})")


class SaveLock:
    """Held while the object lives (or until :meth:`release`)."""

    def __init__(self, fd: int, path: Path, previous: str):
        self.fd, self.path, self.previous = fd, path, previous

    @classmethod
    def acquire(cls, save_dir: str | os.PathLike) -> "SaveLock":
        """Take the lock of ``save_dir`` (created if needed) or raise naming the run that holds it.
        ``previous`` is the holder line of a run that ended without releasing it (a crash), else ''."""
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

    def check(self, checkpoint: str = "the checkpoint") -> None:
        """Raise :class:`SaveDirectoryLost` unless this lock is still held and ``DIR/.lock`` is the very
        file it holds (same inode and device): called before ``checkpoint`` is written and committed."""
        save = self.path.parent
        now = None
        if self.fd >= 0:
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                pass
            held = os.fstat(self.fd)
            if now is not None and (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
                return
        what = ("is no longer locked by this run (its lock was released)" if self.fd < 0 else
                "was deleted while this run was using it" if not save.is_dir() else
                f"lost its {LOCK} while this run was using it" if now is None else
                f"was replaced while this run was using it (its {LOCK} is another file, perhaps another run's)")
        raise directory_lost(save, what, checkpoint)

    def release(self) -> None:
        """Clear the holder line (a clean end: the next run has nothing to take over) and unlock."""
        if self.fd >= 0:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass                           # a read-only or vanished file: the lock goes all the same
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.release()
