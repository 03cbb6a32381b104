"""The trainer's entry point: parse -> plan -> preflight (last, --save's lock) -> build -> train; how a run ends.

``pretrain_gpt.py`` calls :func:`main_process`; a launcher that forks ranks (tests, the layout fuzzer)
calls :func:`run_program` and then :func:`exit_process`. Every step before the process groups refuses
bad input with one line and status 2 (:mod:`megazero.cli.job`, :mod:`megazero.cli.plan`,
:mod:`megazero.cli.preflight`); :mod:`megazero.cli.run` builds the run and trains it. The error policy is
here, decided by the error's class (:mod:`megazero.errors`):

=========================================  ========  ===================================================
error                                      status    who says the line
=========================================  ========  ===================================================
a bad flag, file or tokenizer (before      2         rank 0 (another rank only a line it alone found)
any process group)
the checkpoint resumed has finished        0         rank 0
``TrainingStopped``, ``CheckpointError``   1         rank 0 (every rank has the same line)
``ReplicaGroupLost`` (torchft)             1         every rank that saw it, with its rank
``DataError``, ``OSError`` in the run      1         every rank that saw it, with its rank
a peer gone, a collective timed out        1         every rank, the first to fail dated first
=========================================  ========  ===================================================
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import sys
import time
import traceback

import torch.distributed as dist

from megazero.cli.job import parse_job
from megazero.cli.launcher import SECONDHAND, end_launch_after_refusal, report_to_launcher
from megazero.cli.plan import plan_memory
from megazero.cli.preflight import preflight
from megazero.cli.run import resolve_data, run
from megazero.config import FLAG
from megazero.errors import (
    CheckpointError,
    DataError,
    NothingToDo,
    PreflightError,
    ReplicaGroupLost,
    TokenizerError,
    TrainingStopped,
)

PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")   # gloo, when a rank left


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()                         # --exit-duration-in-mins counts from here
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    job, args = parse_job(argv, world)                 # every flag validated here, once
    job = _replica_group_save(job)
    rank = int(os.environ.get("RANK", "0"))
    embedded_default = not (job.data.mock_data or job.data.data_path)
    try:                                               # ... and every file, still before any process group
        job, tokenizer = resolve_data(job)
        job = plan_memory(job, world)                  # --memory-budget-gib: the planner's recompute / offload
        lock = preflight(job, args.backend, rank)      # last: --save's lock, once nothing refuses the run
    except NothingToDo as e:                           # a finished run resumed: say so, succeed
        if rank == 0:
            print(f" {e}", flush=True)
        return 0
    except (PreflightError, TokenizerError, DataError, OSError) as e:
        stop(f"{e}", 2, rank, after_rank0=True)        # bad input: status 2, as for a bad flag
    try:
        return run(job, args.backend, tokenizer, show_sample=embedded_default, lock=lock, started=started)
    except (ReplicaGroupLost, DataError, OSError) as e:   # found by some ranks only (a lost quorum, a disk)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        stop(f"rank {rank}: {e}" if world > 1 else f"{e}", 1, rank, every_rank=True)
    except (TrainingStopped, CheckpointError) as e:   # the same line on every rank: rank 0 says it
        stop(f"{e}", 1, rank)
    except RuntimeError as e:                          # gloo and NCCL say "timed out" / "Timeout"
        if any(text in str(e) for text in PEER_GONE):  # another rank stopped first, with its own line
            stop(f"rank {rank}: {SECONDHAND}: {what_the_other_rank_said()} ({str(e).splitlines()[0][:200]})",
                 1, rank, every_rank=True, secondhand=True)
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        # Only the ranks waiting on the stuck one time out, and the launcher stops the rest as soon as
        # the first exits: each rank that saw the timeout says so.
        stop(f"rank {rank}: a collective did not complete within {FLAG.distributed_timeout_minutes} "
             f"{job.parallel.distributed_timeout_minutes:g} (a rank stopped, died or is far slower): "
             f"{str(e).splitlines()[0][:300]}", 1, rank, every_rank=True)
    finally:
        if lock is not None:                           # however the run ended: the next run takes nothing over
            lock.release()


def _replica_group_save(job):
    """With torchft replica groups, each group's checkpoints go to a directory of its own under ``--save``;
    ``--load`` equal to ``--save`` (the restart pattern) resumes from that group's own directory."""
    ck = job.checkpoint
    save = job.fault_tolerance.save_dir(ck.save)
    if save == ck.save:
        return job
    load = save if ck.load is not None and os.path.abspath(ck.load) == os.path.abspath(ck.save) else ck.load
    return dataclasses.replace(job, checkpoint=dataclasses.replace(ck, save=save, load=load))


def stop(message: str, status: int, rank: int, every_rank: bool = False, secondhand: bool = False,
         after_rank0: bool = False) -> None:
    """End the run with one line on stderr and ``status``: from rank 0 only (not one line per rank for
    what every rank sees alike: the checkpoint code gives every rank the failing rank's line), or
    ``every_rank`` for what only some ranks see. Under torchrun the line is also this worker's error
    file, so the launcher's failure report shows it instead of "To enable traceback see ...";
    ``secondhand`` (this rank stopped only because another did) dates it a second later, so the
    report's root cause is the rank that failed first. ``after_rank0`` (before any process group, where
    ranks cannot agree): rank 0 says it at once; another rank waits for the launcher to stop it (when
    rank 0 failed too, as for a file every rank reads) and otherwise says its own line, which only it
    found (a file on its node). There, under a single-node torchrun, rank 0 ends the launch once it has
    said the line (:func:`megazero.cli.launcher.end_launch_after_refusal`): the line is all the job prints."""
    if after_rank0 and rank != 0:
        time.sleep(5.0)
        every_rank, message = True, f"rank {rank}: {message}"
    if not secondhand:
        note_own_error()
    if rank == 0 or every_rank:
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
        if not (after_rank0 and end_launch_after_refusal()):        # before any group: the line is all
            report_to_launcher(f"pretrain_gpt.py: error: {message}", message, secondhand)
    if rank != 0 and not every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(5.0)            # rank 0 says the line: leaving first could have the launcher stop it unsaid
    raise SystemExit(status)


def _errors_said():
    """(the run's store, with a short timeout: the process is ending; the key counting errors said)."""
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=10))
    return store, f"megazero/errors-said/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"   # per attempt


def note_own_error() -> None:
    """Count, in the run's store, a rank that stops with an error of its own (its line, or a traceback),
    before it leaves: a rank that then loses its connection to it can tell such a stop from a death
    without a word (:func:`what_the_other_rank_said`). Nothing before the process groups exist."""
    if dist.is_initialized():
        try:
            store, key = _errors_said()
            store.add(key, 1)
        except Exception:  # noqa: BLE001 - the store's host is gone too: nothing to tell anyone
            pass


def what_the_other_rank_said() -> str:
    """For a rank that lost its connection to another: where that rank's error is. A rank that stopped
    with an error of its own counted it in the store before leaving; none counted means it died
    without one (a signal: SIGKILL from the out-of-memory killer or from outside), and its exit status
    is only the launcher's to know."""
    try:
        store, key = _errors_said()
        said = store.add(key, 0)
    except Exception:  # noqa: BLE001 - the store lived in the rank that is gone (rank 0 outside torchrun)
        said = None
    if said:
        return "its error is the line above (and torchrun's root cause)"
    if said is None:
        return "it left no word this rank can read (its error, if it said one, is above)"
    return ("it died without an error message (killed by a signal: likely out of memory, or killed from "
            "outside); torchrun's failure report names the rank and the signal")


def exit_process(code: int) -> None:
    """End the process with ``code`` once its process groups are gone, without the interpreter's teardown.

    A run that stopped with an error still holds its model, engine and process groups through the
    error's traceback. Left to the interpreter's teardown, a gloo group's worker thread may then free a
    tensor while Python is being torn down, and the process aborts ("terminate called without an active
    exception", status -6) after the run's one-line error. So they are freed here, while the interpreter
    is whole; the groups are destroyed (after a barrier on success: gloo aborts a rank whose peer hangs
    up while it still reads), the output is flushed and the process ends at once.
    """
    gc.collect()
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_status(stop: SystemExit) -> int:
    """The status a ``SystemExit`` asks for (argparse's 2, :func:`stop`'s), its message said as Python would."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def run_program(argv: list[str] | None = None) -> int:
    """The exit status of ``python pretrain_gpt.py argv``: :func:`main`, its ``SystemExit`` and any other
    error said as the program says them (a launcher that forks ranks runs this, then :func:`exit_process`)."""
    try:
        return main(argv)
    except SystemExit as stopped:
        return exit_status(stopped)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001 - an unforeseen error keeps its traceback
        traceback.print_exc()
        note_own_error()
        return 1


def main_process() -> None:
    """``python pretrain_gpt.py``: the program, then the process's end (:func:`exit_process`)."""
    exit_process(run_program())
