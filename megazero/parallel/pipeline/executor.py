"""Run one pipeline rank's action list: the compute through :class:`StageRunner`, each batch of p2p
operations through :class:`StageComm` -- the one executor behind every schedule.

The executor keeps two small tables keyed by (tensor, chunk, micro-batch): what this rank computed
and has yet to send (a forward's output, a backward's input gradient), and what it received and has
yet to use (posted receives of an ``Exchange(wait=False)`` are waited on only when the compute that
needs them starts). A tensor whose next (or previous) virtual stage runs on this rank -- the turn
of the V shape -- goes straight into the second table, detached as if it had travelled. Each p2p
op of a batch is put on the wire towards the rank that runs its peer stage (the previous rank for
an odd chunk's "next" in the V). The schedule has already been checked by
:func:`checked_schedule`, so a missing entry here is a bug in this module, reported as such.
"""
from __future__ import annotations

import functools
import time

from megazero.parallel.pipeline.actions import Action, Compute, Exchange, Kind, Op
from megazero.parallel.pipeline.partition import (
    LOOP,
    runs_backwards,
    stage_position,
    virtual_stage,
)
from megazero.parallel.pipeline.simulate import simulate

_ACT, _GRAD = "activation", "gradient"
_WIRE = {Op.SEND_NEXT: "send_next", Op.RECV_PREV: "recv_prev", Op.SEND_PREV: "send_prev", Op.RECV_NEXT: "recv_next"}
_WIRE_REVERSED = {Op.SEND_NEXT: "send_prev", Op.RECV_PREV: "recv_next", Op.SEND_PREV: "send_next",
                  Op.RECV_NEXT: "recv_prev"}


def stage_shape_of(generator) -> str:
    """How a schedule places the virtual stages (``partition.LOOP`` unless the generator says
    ``stage_shape = partition.V``, as ZB-V does)."""
    return getattr(generator, "stage_shape", LOOP)


@functools.lru_cache(maxsize=128)
def checked_schedule(generator, pp: int, m: int, v: int, forward_only: bool) -> tuple[tuple[Action, ...], ...]:
    """``generator(pp, m, v, forward_only)``'s lists, after :func:`simulate.simulate` found them free of
    deadlock and of missing data (raises ``ScheduleError`` otherwise). Cached per arguments, so each
    (schedule, pp, m, v) is checked once per process."""
    lists = generator(pp, m, v, forward_only)
    if len(lists) != pp:
        raise ValueError(f"schedule {getattr(generator, '__name__', generator)} gave {len(lists)} action "
                         f"lists for {pp} pipeline ranks")
    simulate(lists, m, v, forward_only, shape=stage_shape_of(generator))
    return tuple(tuple(acts) for acts in lists)


def execute(actions, runner, comm) -> None:
    """Run ``actions`` (this rank's list) with ``runner`` (a StageRunner: ``pipeline``, ``v``,
    ``shape``) and ``comm`` (a StageComm, or None when the list has no Exchange)."""
    inbox, outbox = {}, {}
    shape = getattr(runner, "shape", LOOP)
    pp, me = runner.pipeline.size, runner.pipeline.rank

    def produced(tensor: str, a: Compute, got, step: int) -> None:
        if got is None:
            return
        rank, chunk = stage_position(virtual_stage(me, pp, a.chunk, shape) + step, pp, shape)
        if rank == me:                                   # the turn of the V: no message
            # a new leaf, as a received activation is (the next chunk's backward stops at it)
            inbox[(tensor, chunk, a.micro)] = got.detach() if tensor == _ACT and hasattr(got, "detach") else got
        else:
            outbox[(tensor, a.chunk, a.micro)] = got

    stats = getattr(runner, "stats", None)
    timed = stats is not None and stats.time_computes
    for a in actions:
        if isinstance(a, Exchange):
            _exchange(a, comm, inbox, outbox, shape)
            continue
        if a.kind is Kind.FORWARD:
            x = None if runner.is_first(a.chunk) else _take(inbox, (_ACT, a.chunk, a.micro), a)
            t0 = time.perf_counter() if timed else 0.0   # after _take: a receive's wait is wait_s's
            produced(_ACT, a, runner.forward(a.chunk, a.micro, x), +1)
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            dy = None if runner.is_last(a.chunk) else _take(inbox, (_GRAD, a.chunk, a.micro), a)
            run = runner.backward if a.kind is Kind.BACKWARD else runner.backward_input
            t0 = time.perf_counter() if timed else 0.0
            produced(_GRAD, a, run(a.chunk, a.micro, dy), -1)
        else:
            t0 = time.perf_counter() if timed else 0.0
            runner.backward_weight(a.chunk, a.micro)
        if timed:
            stats.add_compute(a.kind.value, time.perf_counter() - t0)
    if inbox or outbox:
        raise RuntimeError(f"executor bug: step ended with {len(inbox)} received tensors unused and "
                           f"{len(outbox)} computed tensors unsent")


def _exchange(ex: Exchange, comm, inbox: dict, outbox: dict, shape: str) -> None:
    kwargs, wanted = {"wait": ex.wait}, {}
    for p in ex.ops:
        key = (p.op.tensor, p.chunk, p.micro)
        slot = (_WIRE_REVERSED if runs_backwards(p.chunk, shape) else _WIRE)[p.op]
        if slot in kwargs:
            raise RuntimeError(f"executor bug: {ex} puts two operations on the {slot} slot")
        if p.op.is_send:
            kwargs[slot] = outbox.pop(key)
        else:
            kwargs[slot] = True
            wanted[slot] = key
    from_prev, from_next = comm.exchange(**kwargs)
    for slot, got in (("recv_prev", from_prev), ("recv_next", from_next)):
        if slot in wanted:
            if got is None:
                raise RuntimeError(f"executor bug: {ex} received nothing from the "
                                   f"{slot[5:]} rank (is the p2p a ring?)")
            inbox[wanted[slot]] = got


def _take(inbox: dict, key, a: Compute):
    if key not in inbox:
        raise RuntimeError(f"executor bug: {a} found no received {key[0]}")
    got = inbox.pop(key)
    return got.get() if hasattr(got, "get") else got
