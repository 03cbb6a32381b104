"""``--async-save``: checkpoints written and committed in a background thread while training goes on.

At a save step the training loop is blocked only for what must happen then, on every rank:

1. wait for the previous background save (its failure, if any, is raised here: the run stops);
2. copy this rank's pieces -- weights, fp32 masters, Adam moments -- to host memory (the snapshot:
   training may change the live tensors from the next step on), capture the RNG states and the
   index fields (:func:`megazero.checkpoint.distributed.plan_save`);
3. check the snapshot is finite, over all ranks (:mod:`megazero.checkpoint.finite`).

A thread then writes the snapshot and commits it exactly as a synchronous save does (temporary
directory, rename, tracker by atomic rename: :func:`megazero.checkpoint.distributed.write_planned`).
Its collectives (the ranks agreeing that every file is written before rank 0 commits) run over a
gloo group of their own, created once by :class:`AsyncCheckpointWriter`, so they never interleave
with the training's collectives. A crash while the thread writes leaves the previous checkpoint the
latest, as a crash during a synchronous save does; a write that fails (a full disk, a read-only
directory) removes its temporary directory, and the next wait stops the run with one line saying what
failed. Rank 0 checks ``--save``'s lock before writing and before committing, as a synchronous save does
(:meth:`megazero.checkpoint.lock.SaveLock.check`).

The price: host memory for one copy of the rank's checkpoint shard, kept between saves: the next
snapshot is copied into it (fresh memory costs first-touch page faults: 0.15 vs 0.02 s for 376 MB).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from megazero.checkpoint.distributed import SavePlan, write_planned
from megazero.checkpoint.format import write_failed
from megazero.checkpoint.lock import SaveLock
from megazero.errors import CheckpointError


class AsyncCheckpointWriter:
    """At most one background save at a time. Construct on every rank (it creates a process group);
    ``lock``: rank 0's ``--save`` lock, checked before each save is written and committed."""

    def __init__(self, timeout=None, lock: SaveLock | None = None):
        self.lock = lock
        kwargs = {"timeout": timeout} if timeout is not None else {}
        self.group = dist.new_group(backend="gloo", **kwargs) if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._plan: SavePlan | None = None
        self.buffers: list[torch.Tensor] | None = None     # the last written snapshot, for the next one

    @property
    def busy(self) -> bool:
        """A background save was started and not yet waited for."""
        return self._thread is not None

    def start(self, plan: SavePlan, done: Callable[[SavePlan, float], None] | None = None) -> None:
        """Write and commit ``plan`` (its pieces host copies) in a background thread; ``done(plan,
        seconds)`` is called from that thread once it is committed. Waits for a previous save first."""
        self.wait()
        self._plan = plan

        def run() -> None:
            t0 = time.perf_counter()
            try:
                write_planned(plan, torch.device("cpu"), self.group, self.lock)
                if done is not None:
                    done(plan, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - reported by wait(), on the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name="megazero-async-save", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Return once the background save (if any) is committed; raise :class:`CheckpointError` with
        its error when it failed (one line: the run stops with it)."""
        if self._thread is None:
            return
        self._thread.join()
        plan, error = self._plan, self._error
        self._thread, self._plan, self._error = None, None, None
        self.buffers = plan.snapshot_tensors
        if error is not None:
            if isinstance(error, OSError):      # the file system refused: what and the fix
                raise write_failed(error, plan.tmp, plan.final, f"the background save of {plan.final}") from error
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"the background save of {plan.final} failed: {error}") from error
            first = (str(error).splitlines() or [""])[0]
            raise CheckpointError(f"the background save of {plan.final} failed: {type(error).__name__}: "
                                  f"{first}") from error
