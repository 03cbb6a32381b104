"""The swap files of ZeRO-Infinity (``--nvme-path``): one directory per rank, regions of a file reserved
up front, tensors read and written through the operating system, and the files removed however the
run ends.

Swap files. ``DIR/megazero-swap-<host>-<pid>-rank<r>/{optimizer,params}.swp``: one set per rank, their
space reserved when the engine is built (``posix_fallocate``: a full drive is an error then, not in the
middle of a run; the trainer also checks the free space before anything starts, ``megazero/cli/preflight.py``).
They are removed by ``ZeroEngine.close()``, at interpreter exit (also after an error), on SIGTERM, and, for
a process killed outright, by the next run that uses the directory (directories of dead processes on this
host). The I/O goes through the operating system's page cache: the process's resident memory holds only
the sub-group buffers (offload.py), and the cache is the kernel's to drop.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megazero.config import FLAG

REGION_ALIGN = 4096          # bytes: every region of a swap file starts on a page
SWAP_PREFIX = "megazero-swap-"


class OffloadError(RuntimeError):
    """The swap directory cannot hold the run's files; the message names --nvme-path and the fix."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (bf16 too: viewed as uint8)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(bytearray())


_LIVE_DIRS: set[str] = set()       # this process's swap directories, removed on exit or SIGTERM
_SIGTERM_LOCK = threading.Lock()
_SIGTERM_INSTALLED = False


def _remove_live_dirs() -> None:
    for path in list(_LIVE_DIRS):
        shutil.rmtree(path, ignore_errors=True)
        _LIVE_DIRS.discard(path)


def _on_sigterm(signum, frame) -> None:
    _remove_live_dirs()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_cleanup() -> None:
    """Remove the swap directories when the process is terminated (torchrun stops workers with SIGTERM);
    only where nobody else handles SIGTERM, and only from the main thread (Python's rule)."""
    global _SIGTERM_INSTALLED
    with _SIGTERM_LOCK:
        if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _SIGTERM_INSTALLED = True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_swap_dirs(root: str | os.PathLike) -> list[Path]:
    """Remove the swap directories under ``root`` left by processes of this host that no longer run
    (a run killed outright cannot remove its own); returns what was removed."""
    host, removed = socket.gethostname(), []
    for entry in Path(root).iterdir():
        if not entry.name.startswith(SWAP_PREFIX) or not entry.is_dir():
            continue
        try:
            owner, pid, _ = entry.name[len(SWAP_PREFIX):].rsplit("-", 2)
            pid = int(pid)
        except ValueError:
            continue
        if owner == host and pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class SwapFile:
    """One scratch file of a rank: regions reserved on the drive, read and written by byte offset."""

    def __init__(self, path: Path, flag: str):
        self.path, self.flag, self.nbytes = Path(path), flag, 0
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._mapped = None

    def reserve(self, nbytes: int) -> int:
        """Append a page-aligned region of ``nbytes``; returns its offset. The space is allocated now."""
        offset = round_up(self.nbytes, REGION_ALIGN)
        end = offset + round_up(max(nbytes, 1), REGION_ALIGN)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, offset, end - offset)
            else:                                            # no fallocate (macOS): size the file, check space
                if shutil.disk_usage(self.path.parent).free < end - offset:
                    raise OSError(28, "No space left on device")
                os.ftruncate(self.fd, end)
        except OSError as e:
            free = shutil.disk_usage(self.path.parent).free
            raise OffloadError(f"{self.flag} {self.path.parent.parent}: cannot reserve {(end - offset) / 2**20:.1f} MiB "
                               f"for {self.path.name} ({e.strerror}; {free / 2**30:.2f} GiB free): free space there, "
                               f"or choose a larger drive") from None
        self.nbytes = end
        self._mapped = None
        return offset

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` from ``offset``."""
        view, done = _byte_view(out), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {offset + done}")
            done += n

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Write the contiguous CPU tensor ``src`` at ``offset``."""
        view, done = _byte_view(src), 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def mapped(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``numel`` elements at ``offset`` backed by the file itself (a shared memory map):
        for checkpoints and initialisation, which read or write the state in place. The map lives as long
        as a view of it."""
        whole = self._mapped() if self._mapped is not None else None
        if whole is None:
            whole = torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
            self._mapped = weakref.ref(whole)
        size = torch.empty(0, dtype=dtype).element_size()
        return whole[offset:offset + numel * size].view(dtype)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SwapDir:
    """This rank's directory of swap files under ``--nvme-path`` (see the module docstring); ``flag``: the
    option its messages name (default that one)."""

    def __init__(self, root: str | os.PathLike, rank: int, flag: str | None = None):
        root, flag = Path(root), flag or FLAG.nvme_path
        if not root.is_dir():
            raise OffloadError(f"{flag} {root} is not a directory: give an existing directory on a fast local drive")
        remove_stale_swap_dirs(root)
        self.path = root / f"{SWAP_PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank:05d}"
        self.flag = flag
        try:
            self.path.mkdir()
        except OSError as e:
            raise OffloadError(f"{flag} {root}: cannot create {self.path.name} ({e.strerror}): choose a directory "
                               f"you can write") from None
        self.files: list[SwapFile] = []
        _LIVE_DIRS.add(str(self.path))
        _install_sigterm_cleanup()
        self._finalizer = weakref.finalize(self, _remove_dir, str(self.path))

    def file(self, name: str) -> SwapFile:
        f = SwapFile(self.path / name, self.flag)
        self.files.append(f)
        return f

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def close(self) -> None:
        """Close and remove every file (also done at interpreter exit if never called)."""
        for f in self.files:
            f.close()
        self._finalizer()


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _LIVE_DIRS.discard(path)


def io_thread(name: str) -> ThreadPoolExecutor:
    """One worker thread for ordered background I/O."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"megazero-{name}")


__all__ = ["OffloadError", "REGION_ALIGN", "SWAP_PREFIX", "SwapDir", "SwapFile", "io_thread", "remove_stale_swap_dirs",
           "round_up"]
