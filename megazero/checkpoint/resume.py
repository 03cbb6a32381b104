"""What ``--load``, ``--save``, ``--save-interval`` and ``--finetune`` mean for a training run.

    state = resume(job, chunks, engine, topo)                 # TrainState to start from
    train(..., state=state, save=checkpoint_saver(job, chunks, engine, topo))

``--load DIR``:
    resumes from DIR's latest checkpoint (weights, optimizer, scheduler, RNG, iteration, consumed
    samples), whatever layout wrote it. No checkpoint there is an error naming DIR -- except in
    auto-resume mode, ``--load`` equal to ``--save`` (the usual restart pattern: the same command
    line starts a run and resumes it after a failure), where the run starts fresh and says so.
``--no-load-optim`` / ``--no-load-rng``:
    resume as above, but with a fresh optimizer (masters from the loaded weights) / the seed's random states.
``--finetune``:
    loads weights only (no optimizer state, iteration 0, fresh RNG). If ``--save`` (a different
    directory) already holds a checkpoint of this finetuning run, that one is resumed fully instead,
    so restarting a crashed finetune continues it rather than starting over.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from megazero.checkpoint.agree import raise_first_error
from megazero.checkpoint.async_save import AsyncCheckpointWriter
from megazero.checkpoint.distributed import (
    latest_iteration,
    load_checkpoint,
    plan_save,
    save_checkpoint,
)
from megazero.checkpoint.format import iter_dir_name, write_failed
from megazero.checkpoint.lock import SaveLock
from megazero.config import FLAG
from megazero.errors import CheckpointError
from megazero.state import TrainState

log = logging.getLogger(__name__)


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def resume(job, chunks, engine, topo, extra_rng: dict | None = None, say: Callable[[str], None] | None = None):
    """The TrainState to start from, after loading whatever ``job.checkpoint`` asks for. Collective."""
    ck = job.checkpoint
    say = say or (lambda msg: log.info(msg) if topo.rank == 0 else None)
    kw = dict(chunks=chunks, engine=engine, topo=topo, job=job, extra_rng=extra_rng)
    if ck.finetune and ck.save and not _same_dir(ck.load, ck.save) and latest_iteration(ck.save) is not None:
        state = load_checkpoint(ck.save, **kw)
        say(f" resumed the finetuning run from {ck.save} at iteration {state.iteration}")
        return state
    if ck.load is None:
        if ck.finetune:
            raise CheckpointError(f"{FLAG.finetune} needs {FLAG.load} DIR (the checkpoint whose weights to start from)")
        return TrainState()
    if latest_iteration(ck.load) is None:
        if _same_dir(ck.load, ck.save):
            say(f" no checkpoint in {ck.load} yet ({FLAG.load} equals {FLAG.save}): starting fresh")
            return TrainState()
        what = "does not exist" if not os.path.isdir(ck.load) else "holds no checkpoint (no latest_checkpointed_iteration.txt)"
        raise CheckpointError(f"{FLAG.load} {ck.load} {what}: point {FLAG.load} at a {FLAG.save} directory of an "
                              f"earlier run, or set {FLAG.load} equal to {FLAG.save} to start fresh and resume "
                              f"automatically after a restart")
    state = load_checkpoint(ck.load, weights_only=ck.finetune, load_optim=not ck.no_load_optim,
                            load_rng=not ck.no_load_rng, **kw)
    if ck.finetune:
        say(f" loaded weights only from {ck.load} ({FLAG.finetune}): iteration 0, fresh optimizer")
    else:
        fresh = [what for what, on in (("optimizer", ck.no_load_optim), ("random states", ck.no_load_rng)) if on]
        say(f" resumed from {ck.load} at iteration {state.iteration} ({state.consumed_samples} samples consumed)"
            + (f"; fresh {' and '.join(fresh)} ({FLAG.no_load_optim} / {FLAG.no_load_rng})" if fresh else ""))
    return state


class CheckpointSaver:
    """``save(state)`` for the training loop: writes ``state``'s checkpoint into ``--save`` and returns the
    seconds the caller was blocked. With ``--async-save`` the write and commit run in a background
    thread (:mod:`megazero.checkpoint.async_save`); ``finish()`` waits for it (the end of a run, or a
    stop) and raises its failure. Construct on every rank (collective with ``--async-save``); ``lock``
    (rank 0's lock of ``--save``) is checked before each save is written and committed, so a directory
    deleted or replaced under the run stops it before anything is written there."""

    def __init__(self, job, chunks, engine, topo, extra_rng: dict | None = None,
                 say: Callable[[str], None] | None = None, lock: SaveLock | None = None):
        self.job, self.chunks, self.engine, self.topo, self.extra_rng = job, chunks, engine, topo, extra_rng
        self.say = say or (lambda msg: log.info(msg) if topo.rank == 0 else None)
        self.lock = lock
        self.writer = AsyncCheckpointWriter(topo.timeout, lock) if job.checkpoint.async_save else None

    def __call__(self, state) -> float:
        t0 = time.perf_counter()
        kw = dict(chunks=self.chunks, engine=self.engine, topo=self.topo, job=self.job, extra_rng=self.extra_rng)
        if self.writer is None:
            try:
                path = save_checkpoint(self.job.checkpoint.save, state, lock=self.lock, **kw)
            except Exception as e:  # noqa: BLE001 - every rank is here (the save agrees before raising)
                _save_failed(e, Path(self.job.checkpoint.save), state.iteration)
            blocked = time.perf_counter() - t0
            self.say(f" saved checkpoint {path} (training blocked {blocked:.3f} s)")
            return blocked
        self.writer.wait()                 # the previous one first: its failure stops the run here
        plan = plan_save(self.job.checkpoint.save, state, snapshot=True, buffers=self.writer.buffers, **kw)
        self.writer.start(plan, lambda p, s: self.say(f" saved checkpoint {p.final} (written in the background "
                                                       f"in {s:.3f} s)"))
        blocked = time.perf_counter() - t0
        self.say(f" saving checkpoint {plan.final} in the background (training blocked {blocked:.3f} s)")
        return blocked

    def finish(self) -> None:
        """Wait for the background save, if any (a no-op for synchronous saves)."""
        if self.writer is not None:
            self.writer.wait()


def checkpoint_saver(job, chunks, engine, topo, extra_rng: dict | None = None,
                     say: Callable[[str], None] | None = None, lock: SaveLock | None = None) -> CheckpointSaver | None:
    """The :class:`CheckpointSaver` for the training loop (None without ``--save``)."""
    if not job.checkpoint.save:
        return None
    return CheckpointSaver(job, chunks, engine, topo, extra_rng, say, lock)


def _save_failed(error: BaseException, save_dir: Path, iteration: int) -> None:
    """A save that failed on some rank (a full disk, ...): every rank raises the failing rank's one line
    (the half-written directory is gone: :func:`megazero.checkpoint.distributed.write_planned` removed it)."""
    final = save_dir / iter_dir_name(iteration)
    if isinstance(error, OSError):
        error = write_failed(error, save_dir / f".{final.name}.tmp", final)
    raise_first_error(error)
