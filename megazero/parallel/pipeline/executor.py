"""Run one pipeline rank's action list: the compute through :class:`StageRunner`, each batch of p2p
operations through :class:`StageComm` -- the one executor behind every schedule.

The executor keeps two small tables keyed by (tensor, chunk, micro-batch): what this rank computed
and has yet to send (a forward's output, a backward's input gradient), and what it received and has
yet to use (posted receives of an ``Exchange(wait=False)`` are waited on only when the compute that
needs them starts). The schedule has already been checked by :func:`checked_schedule`, so a missing
entry here is a bug in this module, reported as such.
"""
from __future__ import annotations

import functools

from megazero.parallel.pipeline.actions import Action, Compute, Exchange, Kind, Op
from megazero.parallel.pipeline.simulate import simulate

_ACT, _GRAD = "activation", "gradient"
_SEND_ARG = {Op.SEND_NEXT: "send_next", Op.SEND_PREV: "send_prev"}
_RECV_ARG = {Op.RECV_PREV: "recv_prev", Op.RECV_NEXT: "recv_next"}


@functools.lru_cache(maxsize=128)
def checked_schedule(generator, pp: int, m: int, v: int, forward_only: bool) -> tuple[tuple[Action, ...], ...]:
    """``generator(pp, m, v, forward_only)``'s lists, after :func:`simulate.simulate` found them free of
    deadlock and of missing data (raises ``ScheduleError`` otherwise). Cached per arguments, so each
    (schedule, pp, m, v) is checked once per process."""
    lists = generator(pp, m, v, forward_only)
    if len(lists) != pp:
        raise ValueError(f"schedule {getattr(generator, '__name__', generator)} gave {len(lists)} action "
                         f"lists for {pp} pipeline ranks")
    simulate(lists, m, v, forward_only)
    return tuple(tuple(acts) for acts in lists)


def execute(actions, runner, comm) -> None:
    """Run ``actions`` (this rank's list) with ``runner`` (a StageRunner) and ``comm`` (a StageComm,
    or None when the list has no Exchange)."""
    inbox, outbox = {}, {}
    for a in actions:
        if isinstance(a, Exchange):
            _exchange(a, comm, inbox, outbox)
        elif a.kind is Kind.FORWARD:
            x = None if runner.is_first(a.chunk) else _take(inbox, (_ACT, a.chunk, a.micro), a)
            out = runner.forward(a.chunk, a.micro, x)
            if out is not None:
                outbox[(_ACT, a.chunk, a.micro)] = out
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            dy = None if runner.is_last(a.chunk) else _take(inbox, (_GRAD, a.chunk, a.micro), a)
            run = runner.backward if a.kind is Kind.BACKWARD else runner.backward_input
            dx = run(a.chunk, a.micro, dy)
            if dx is not None:
                outbox[(_GRAD, a.chunk, a.micro)] = dx
        else:
            runner.backward_weight(a.chunk, a.micro)
    if inbox or outbox:
        raise RuntimeError(f"executor bug: step ended with {len(inbox)} received tensors unused and "
                           f"{len(outbox)} computed tensors unsent")


def _exchange(ex: Exchange, comm, inbox: dict, outbox: dict) -> None:
    kwargs, wanted = {"wait": ex.wait}, {}
    for p in ex.ops:
        key = (p.op.tensor, p.chunk, p.micro)
        if p.op.is_send:
            kwargs[_SEND_ARG[p.op]] = outbox.pop(key)
        else:
            kwargs[_RECV_ARG[p.op]] = True
            wanted[p.op] = key
    from_prev, from_next = comm.exchange(**kwargs)
    for op, got in ((Op.RECV_PREV, from_prev), (Op.RECV_NEXT, from_next)):
        if op in wanted:
            if got is None:
                raise RuntimeError(f"executor bug: {ex} received nothing from the "
                                   f"{'next' if op.towards_next else 'previous'} rank (is the p2p a ring?)")
            inbox[wanted[op]] = got


def _take(inbox: dict, key, a: Compute):
    if key not in inbox:
        raise RuntimeError(f"executor bug: {a} found no received {key[0]}")
    got = inbox.pop(key)
    return got.get() if hasattr(got, "get") else got
