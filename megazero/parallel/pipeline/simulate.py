"""Check a schedule's action lists before they run, and draw them.

:func:`simulate` plays one action list per pipeline rank (``actions.py``) against each other, with
no torch and no threads, under the strictest semantics the backends may have: a batch of p2p
operations returns only once every send in it has met its receive on the peer and every receive its
send (NCCL runs a rank's batches one after the other on its stream; gloo completes a send once the
peer has posted the receive). Sends and receives between a pair of ranks match in posting order,
one channel per ordered pair (NCCL ignores tags), so on a ring of two ranks an activation and a
gradient can meet each other's receive: every message is checked against what the receiving
action expects. It reports, as a :class:`ScheduleError` naming the rank and the action:

- deadlock: no rank can move and some are blocked in a batch (each blocked rank, with the
  operation that would never complete);
- data dependencies: a forward of (chunk c, micro-batch i) before its input activation arrived, a
  backward before its forward or its output gradient, a send of something not computed yet, a
  message received where another was expected, something received and never used, a forward or
  backward missing or run twice.

A stage shape (``partition.py``: the loop of interleaved 1F1B, the V of ZB-V) says which rank runs
which virtual stage: the peer of each message, and the turn of the V, where a rank's chunk hands its
output to its own next chunk with no message (a list that sends it is reported). A batch's
operations are matched in the order ``p2p.StageComm`` posts them on the wire (to and from the
physical next and previous rank), and a batch may hold one operation per wire slot.

Otherwise it returns a :class:`Timeline`: when each compute ran with unit (or given) durations and
free transfers, the bubble, and the peak in-flight activations per rank (micro-batches whose
forward ran and whose backward, or W, has not: what ``PipelineStats.peak_in_flight`` measures).
:func:`render` draws that timeline as text, one row per rank, time running right.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from megazero.parallel.pipeline.actions import Compute, Exchange, Kind, Op
from megazero.parallel.pipeline.partition import (
    LOOP,
    runs_backwards,
    stage_position,
    virtual_stage,
)


class ScheduleError(ValueError):
    """A schedule that would hang or compute on missing data: ``rank``, ``index`` (position in that
    rank's list) and ``action`` say where."""

    def __init__(self, message: str, rank: int | None = None, index: int | None = None, action=None):
        super().__init__(message)
        self.rank, self.index, self.action = rank, index, action


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found for a valid schedule."""

    computes: tuple[tuple[tuple[float, float, Compute], ...], ...]   # per rank: (start, end, action)
    peak_in_flight: tuple[int, ...]
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        """Idle share of pp ranks x the makespan."""
        busy = sum(end - start for row in self.computes for start, end, _ in row)
        total = len(self.computes) * self.makespan
        return 0.0 if total == 0 else 1.0 - busy / total


DEFAULT_DURATIONS = {Kind.FORWARD: 1.0, Kind.BACKWARD: 1.0, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.0}
_ACT, _GRAD = "activation", "gradient"


@dataclass
class _Slot:
    """One posted p2p operation on a channel (src, dst)."""
    rank: int
    index: int
    post_time: float
    payload: tuple            # (tensor, destination virtual stage, micro-batch)


class _Rank:
    def __init__(self, r: int, actions):
        self.r, self.actions, self.pc, self.clock = r, list(actions), 0, 0.0
        self.done: set = set()            # (Kind, chunk, micro)
        self.inbox: set = set()           # (tensor, chunk, micro) received and not yet used
        self.outbox: set = set()          # (tensor, chunk, micro) computed and not yet sent
        self.blocked = None               # (post time, [(channel, position, is_send, P2P)]) while in a batch
        self.in_flight = self.peak = 0
        self.computes: list = []

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.actions) and self.blocked is None

    def where(self) -> str:
        if self.finished:
            return "has finished its list"
        return f"is {'blocked' if self.blocked else 'stopped'} at action {self.pc}: {self.actions[self.pc]}"


class _Sim:
    def __init__(self, lists, m: int, v: int, forward_only: bool, durations, shape: str = LOOP):
        self.pp, self.m, self.v, self.fo, self.shape = len(lists), m, v, forward_only, shape
        per_rank = durations if isinstance(durations, (list, tuple)) else [durations] * self.pp
        if len(per_rank) != self.pp:
            raise ValueError(f"durations for {len(per_rank)} ranks, lists for {self.pp}")
        self.durations = [{**DEFAULT_DURATIONS, **(d or {})} for d in per_rank]
        self.ranks = [_Rank(r, acts) for r, acts in enumerate(lists)]
        self.sends = defaultdict(list)     # (src, dst) -> [_Slot]
        self.recvs = defaultdict(list)

    def fail(self, rk: _Rank, what: str):
        a = rk.actions[rk.pc]
        raise ScheduleError(f"rank {rk.r} action {rk.pc} ({a}) {what}", rk.r, rk.pc, a)

    def stage(self, r: int, c: int) -> int:
        return virtual_stage(r, self.pp, c, self.shape)

    def local_peer(self, r: int, vs: int) -> int | None:
        """This rank's chunk that runs virtual stage ``vs``, or None when another rank runs it."""
        rank, chunk = stage_position(vs, self.pp, self.shape)
        return chunk if rank == r else None

    def produce(self, rk: _Rank, tensor: str, c: int, i: int, peer_vs: int) -> None:
        """A computed tensor: to the outbox, or straight to the inbox of the rank's own chunk that
        runs ``peer_vs`` (the turn of the V)."""
        own = self.local_peer(rk.r, peer_vs)
        if own is None:
            rk.outbox.add((tensor, c, i))
        else:
            rk.inbox.add((tensor, own, i))

    # ---- compute ------------------------------------------------------------------------------
    def compute(self, rk: _Rank, a: Compute) -> None:
        c, i, r, k = a.chunk, a.micro, rk.r, a.kind
        if not (0 <= c < self.v and 0 <= i < self.m):
            self.fail(rk, f"names a chunk or micro-batch outside {self.v} chunks x {self.m} micro-batches")
        if (k, c, i) in rk.done:
            self.fail(rk, "runs a second time")
        vs = self.stage(r, c)
        first, last = vs == 0, vs == self.pp * self.v - 1
        if k is Kind.FORWARD:
            self.take(rk, first, (_ACT, c, i), "its input activation has not arrived")
            if not last:
                self.produce(rk, _ACT, c, i, vs + 1)
            if not self.fo:
                rk.in_flight += 1
                rk.peak = max(rk.peak, rk.in_flight)
        elif self.fo:
            self.fail(rk, "is a backward in a forward-only schedule")
        elif k is Kind.BACKWARD_WEIGHT:
            if (Kind.BACKWARD_INPUT, c, i) not in rk.done:
                self.fail(rk, "runs before the input-gradient backward (I) of the same micro-batch")
            rk.in_flight -= 1
        else:
            if (Kind.FORWARD, c, i) not in rk.done:
                self.fail(rk, "runs before its forward")
            if {(Kind.BACKWARD, c, i), (Kind.BACKWARD_INPUT, c, i)} & rk.done:
                self.fail(rk, "runs a second backward of the same micro-batch")
            self.take(rk, last, (_GRAD, c, i), "its output gradient has not arrived")
            if not first:
                self.produce(rk, _GRAD, c, i, vs - 1)
            if k is Kind.BACKWARD:
                rk.in_flight -= 1
        rk.done.add((k, c, i))
        end = rk.clock + self.durations[r][k]
        rk.computes.append((rk.clock, end, a))
        rk.clock = end

    def take(self, rk: _Rank, own: bool, key, missing: str) -> None:
        if own:
            return
        if key not in rk.inbox:
            self.fail(rk, f"would block: {missing}")
        rk.inbox.remove(key)

    # ---- p2p ----------------------------------------------------------------------------------
    def wire_slot(self, p) -> int:
        """Where ``StageComm`` posts op ``p``: 0 send to the next rank, 1 receive from the previous,
        2 send to the previous, 3 receive from the next (an odd chunk of the V swaps the ranks)."""
        if not runs_backwards(p.chunk, self.shape):
            return p.op.value
        return {Op.SEND_NEXT: 2, Op.RECV_PREV: 3, Op.SEND_PREV: 0, Op.RECV_NEXT: 1}[p.op]

    def post(self, rk: _Rank, ex: Exchange) -> None:
        slots, wire = [], sorted(ex.ops, key=self.wire_slot)
        if len({self.wire_slot(p) for p in wire}) < len(wire):
            self.fail(rk, "has two operations on the same wire slot (one send and one receive per neighbour "
                          "and batch)")
        for p in wire:
            vs = self.stage(rk.r, p.chunk)
            if not (0 <= p.chunk < self.v and 0 <= p.micro < self.m):
                self.fail(rk, f"names a chunk or micro-batch outside {self.v} chunks x {self.m} micro-batches")
            tensor = p.op.tensor
            peer_vs = vs + 1 if p.op.towards_next else vs - 1
            if not 0 <= peer_vs < self.pp * self.v:
                side = "next" if p.op.towards_next else "previous"
                self.fail(rk, f"has {p}, but virtual stage {vs} has no {side} stage")
            if self.local_peer(rk.r, peer_vs) is not None:
                self.fail(rk, f"has {p}, but virtual stage {peer_vs} is on this rank: the hand-off is local")
            peer, key = stage_position(peer_vs, self.pp, self.shape)[0], (tensor, p.chunk, p.micro)
            if p.op.is_send:
                if key not in rk.outbox:
                    self.fail(rk, f"has {p}, which is not computed yet (or was sent already)")
                rk.outbox.remove(key)
                chan, payload = (rk.r, peer), (tensor, peer_vs, p.micro)
                queue = self.sends[chan]
            else:
                chan, payload = (peer, rk.r), (tensor, vs, p.micro)
                queue = self.recvs[chan]
            queue.append(_Slot(rk.r, rk.pc, rk.clock, payload))
            slots.append((chan, len(queue) - 1, p.op.is_send, p))
        rk.blocked = (rk.clock, slots)

    def try_complete(self, rk: _Rank) -> bool:
        post_time, slots = rk.blocked
        done_at = post_time
        for chan, n, is_send, p in slots:
            other = (self.recvs if is_send else self.sends)[chan]
            if len(other) <= n:
                return False
            done_at = max(done_at, other[n].post_time)
        for chan, n, is_send, p in slots:
            if is_send:
                continue
            got, want = self.sends[chan][n], self.recvs[chan][n]
            if got.payload != want.payload:
                self.fail(rk, f"receives the {_describe(want.payload)}, but message {n} from rank {chan[0]} is the "
                              f"{_describe(got.payload)} (sent by its action {got.index})")
            rk.inbox.add((p.op.tensor, p.chunk, p.micro))
        rk.blocked, rk.clock = None, done_at
        rk.pc += 1
        return True

    # ---- driver -------------------------------------------------------------------------------
    def advance(self, rk: _Rank) -> bool:
        """Move rank ``rk`` as far as it goes; True if it moved."""
        moved = False
        while True:
            if rk.blocked is not None:
                if not self.try_complete(rk):
                    return moved
                moved = True
                continue
            if rk.pc >= len(rk.actions):
                return moved
            a = rk.actions[rk.pc]
            if isinstance(a, Compute):
                self.compute(rk, a)
                rk.pc += 1
            elif isinstance(a, Exchange):
                self.post(rk, a)
            else:
                self.fail(rk, "is not a Compute or an Exchange")
            moved = True

    def run(self) -> Timeline:
        # A list, not a generator: every rank moves in each round.
        while any([self.advance(rk) for rk in self.ranks]):  # noqa: C419
            pass
        stuck = [rk for rk in self.ranks if not rk.finished]
        if stuck:
            self.deadlock(stuck)
        for rk in self.ranks:
            self.check_complete(rk)
        makespan = max((rk.clock for rk in self.ranks), default=0.0)
        return Timeline(tuple(tuple(rk.computes) for rk in self.ranks), tuple(rk.peak for rk in self.ranks), makespan)

    def deadlock(self, stuck) -> None:
        lines = []
        for rk in stuck:
            for chan, n, is_send, p in rk.blocked[1]:
                other = (self.recvs if is_send else self.sends)[chan]
                if len(other) > n:
                    continue
                peer = self.ranks[chan[1] if is_send else chan[0]]
                lines.append(f"rank {rk.r} blocks at action {rk.pc} ({rk.actions[rk.pc]}): its {p} never "
                             f"{'meets a receive' if is_send else 'arrives'} (rank {peer.r} {peer.where()})")
                break
        first = stuck[0]
        raise ScheduleError("deadlock: " + "; ".join(lines), first.r, first.pc, first.actions[first.pc])

    def check_complete(self, rk: _Rank) -> None:
        if rk.inbox:
            t, c, i = min(rk.inbox)
            raise ScheduleError(f"rank {rk.r} receives the {t} of chunk {c} micro-batch {i} and never uses it", rk.r)
        kinds = [Kind.FORWARD] if self.fo else [Kind.FORWARD, Kind.BACKWARD]
        for k in kinds:
            for c in range(self.v):
                for i in range(self.m):
                    if (k, c, i) in rk.done or (k is Kind.BACKWARD and (Kind.BACKWARD_WEIGHT, c, i) in rk.done):
                        continue
                    raise ScheduleError(f"rank {rk.r} never runs {Compute(k, c, i)}", rk.r, None, Compute(k, c, i))
        if rk.outbox:
            t, c, i = min(rk.outbox)
            raise ScheduleError(f"rank {rk.r} never sends the {t} of chunk {c} micro-batch {i}", rk.r)


def _describe(payload) -> str:
    tensor, vs, micro = payload
    return f"{tensor} for virtual stage {vs}, micro-batch {micro}"


def simulate(lists, m: int | None = None, v: int | None = None, forward_only: bool | None = None,
             durations: dict | None = None, shape: str = LOOP) -> Timeline:
    """Check one action list per pipeline rank (``lists[r]`` for rank r) and time them.

    m, v, forward_only: the step the lists are for (inferred from the lists when None). durations:
    time units per compute kind (default 1 each), one dict for every rank or a list of one per rank
    (measured costs: a last stage with the loss is slower). shape: how the virtual stages sit on the ranks
    (``partition.LOOP`` or ``partition.V``; a generator's ``stage_shape``). Raises
    :class:`ScheduleError` for a list that would deadlock or break a data dependency."""
    computes = [a for acts in lists for a in acts if isinstance(a, Compute)]
    if m is None:
        m = 1 + max((a.micro for a in computes), default=-1)
    if v is None:
        v = 1 + max((a.chunk for a in computes), default=0)
    if forward_only is None:
        forward_only = all(a.kind is Kind.FORWARD for a in computes)
    return _Sim(lists, m, v, forward_only, durations, shape).run()


def label(a: Compute, v: int) -> str:
    """An action's name in pictures: kind letter and micro-batch, plus the chunk as a letter
    (a = chunk 0, b = chunk 1, ...) when ranks hold several chunks: F3, B3, F3a, B3b."""
    return f"{a.kind.value}{a.micro}" + (chr(ord("a") + a.chunk) if v > 1 else "")


def render(lists, m: int | None = None, v: int | None = None, forward_only: bool | None = None,
           durations: dict | None = None, shape: str = LOOP) -> str:
    """The schedule as text: one row per rank, one column per time unit, ``.`` for idle.

    >>> from megazero.parallel.pipeline.generators import one_f_one_b
    >>> print(render(one_f_one_b(2, 3)))
    rank 0: F0 F1 .. B0 F2 B1 .. B2
    rank 1: .. F0 B0 F1 B1 F2 B2 ..
    """
    if v is None:
        v = 1 + max((a.chunk for acts in lists for a in acts if isinstance(a, Compute)), default=0)
    tl = simulate(lists, m, v, forward_only, durations, shape)
    columns = math.ceil(tl.makespan - 1e-9)
    width = max((len(label(a, v)) for row in tl.computes for _, _, a in row), default=1)
    rows = []
    for r, row in enumerate(tl.computes):
        cells = ["." * width] * columns
        for start, end, a in row:
            for t in range(math.floor(start + 1e-9), math.ceil(end - 1e-9)):
                cells[t] = label(a, v).ljust(width)
        rows.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(rows)
