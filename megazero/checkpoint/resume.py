"""What ``--load``, ``--save``, ``--save-interval`` and ``--finetune`` mean for a training run.

    state = resume(job, chunks, engine, topo)                 # TrainState to start from
    train(..., state=state, save=checkpoint_saver(job, chunks, engine, topo))

``--load DIR``:
    resumes from DIR's latest checkpoint (weights, optimizer, scheduler, RNG, iteration, consumed
    samples), whatever layout wrote it. No checkpoint there is an error naming DIR -- except in
    auto-resume mode, ``--load`` equal to ``--save`` (the usual restart pattern: the same command
    line starts a run and resumes it after a failure), where the run starts fresh and says so.
``--finetune``:
    loads weights only (no optimizer state, iteration 0, fresh RNG). If ``--save`` (a different
    directory) already holds a checkpoint of this finetuning run, that one is resumed fully instead,
    so restarting a crashed finetune continues it rather than starting over.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from megazero.checkpoint.agree import raise_first_error
from megazero.checkpoint.distributed import latest_iteration, load_checkpoint, save_checkpoint
from megazero.checkpoint.format import CheckpointError, iter_dir_name, write_failed
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
            raise CheckpointError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
        return TrainState()
    if latest_iteration(ck.load) is None:
        if _same_dir(ck.load, ck.save):
            say(f" no checkpoint in {ck.load} yet (--load equals --save): starting fresh")
            return TrainState()
        what = "does not exist" if not os.path.isdir(ck.load) else "holds no checkpoint (no latest_checkpointed_iteration.txt)"
        raise CheckpointError(f"--load {ck.load} {what}: point --load at a --save directory of an earlier run, "
                              f"or set --load equal to --save to start fresh and resume automatically after a restart")
    state = load_checkpoint(ck.load, weights_only=ck.finetune, **kw)
    if ck.finetune:
        say(f" loaded weights only from {ck.load} (--finetune): iteration 0, fresh optimizer")
    else:
        say(f" resumed from {ck.load} at iteration {state.iteration} "
            f"({state.consumed_samples} samples consumed)")
    return state


def checkpoint_saver(job, chunks, engine, topo, extra_rng: dict | None = None,
                     say: Callable[[str], None] | None = None) -> Callable | None:
    """``save(state)`` for the training loop (None without ``--save``)."""
    if not job.checkpoint.save:
        return None
    say = say or (lambda msg: log.info(msg) if topo.rank == 0 else None)

    def save(state) -> None:
        try:
            path = save_checkpoint(job.checkpoint.save, state, chunks=chunks, engine=engine, topo=topo, job=job,
                                   extra_rng=extra_rng)
        except Exception as e:  # noqa: BLE001 - every rank is here (the save agrees before raising)
            _save_failed(e, Path(job.checkpoint.save), state.iteration, topo.rank)
        say(f" saved checkpoint {path}")

    return save


def _save_failed(error: BaseException, save_dir: Path, iteration: int, rank: int) -> None:
    """A save that failed on some rank (a full disk, ...): the half-written directory is removed (by rank
    0, once every rank has stopped writing) and every rank raises the failing rank's one line."""
    final = save_dir / iter_dir_name(iteration)
    tmp = save_dir / f".{final.name}.tmp"
    if isinstance(error, OSError):
        error = write_failed(error, tmp, final)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise_first_error(error)
