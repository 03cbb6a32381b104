"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; the V schedule of the
zero-bubble paper) as a schedule generator: two model chunks per rank placed in a V.

Placement (``partition.V``): chunk 0 of rank r runs virtual stage r, chunk 1 runs stage 2pp-1-r. A
micro-batch goes down the ranks through the chunk 0s, turns on rank pp-1 (its chunk 0 hands its
output to its own chunk 1: no message) and comes back up through the chunk 1s to the loss on rank 0,
which holds the first and the last stage. Gradients run the V the other way.

Each backward is split into ``I`` (input gradient, which the previous stage waits for) and ``W``
(weight gradients, which nobody waits for; ``split_backward.py``). The lists come from a lockstep
like ZB-H1's (``zero_bubble.py``): time runs in unit steps, and at each step every rank picks one
compute from what it has at the start of the step, in this order: the next forward of chunk 1, then
of chunk 0 (each if its input is in and the rank holds fewer than ``2 * pp`` micro-batch chunk sets),
the next I of chunk 0, then of chunk 1 (if its output gradient is in), else the oldest pending W.
After the step each rank posts one batch: what it just computed goes to the rank that runs the
neighbouring stage, and it receives what its neighbours just computed for it. Each batch meets the
neighbours' batches of the same step, so the lists are deadlock-free by construction; the simulator
checks them anyway (tests: pp 2-8, m 1-16).

Memory. A chunk holds half of a rank's layers, so ``2 * pp`` chunk sets held from F to W are
``pp`` sets of the rank's layers: 1F1B's peak (on its rank 0), on every rank.

Bubble, with F = I = W = 1 unit per chunk (a rank's whole work is 6m units): the paper's ZB-V
reaches ``(pp-1)/(6m+pp-1)``, about half of ZB-H1's ``(pp-1)/(3m+pp-1)`` in the same units. These
lists reach it exactly at m = pp and for every m >= 3pp/2 (tested for pp 2-8, m up to 16); for m
a little above pp (pp + 1 .. 3pp/2) the greedy steps lose up to 8 points of it (pp 8, m 9: 0.194
against 0.115), still below ZB-H1's (0.206). pp = 4, m = 8 (``simulate.render``; ``a`` = chunk 0,
``b`` = chunk 1) is in docs/parallelism.md.
"""
from __future__ import annotations

from megazero.config import FLAG
from megazero.parallel.pipeline.actions import P2P, Action, Compute, Kind, Op, batch
from megazero.parallel.pipeline.partition import V, stage_position, virtual_stage


def zb_v(pp: int, m: int, v: int = 2, forward_only: bool = False) -> list[list[Action]]:
    """ZB-V over two chunks per rank in the V shape (see the module docstring)."""
    if v != 2:
        raise ValueError(f"the zb-v schedule runs two model chunks per rank in a V, got {v}: leave "
                         f"{FLAG.num_layers_per_virtual_pipeline_stage} unset (or num-layers / (2 * pp))")
    ranks = [_RankState(r, pp, m, forward_only) for r in range(pp)]
    lists: list[list[Action]] = [[] for _ in range(pp)]
    while not all(st.finished for st in ranks):
        picked = [st.pick() for st in ranks]
        ops: list[list[P2P]] = [[] for _ in range(pp)]
        for r, (st, a) in enumerate(zip(ranks, picked)):
            if a is None:
                continue
            lists[r].append(a)
            st.apply(a)
            dest = _destination(a, r, pp)
            if dest is None:
                continue
            rank, chunk = dest
            is_act = a.kind is Kind.FORWARD
            (ranks[rank].acts if is_act else ranks[rank].grads).add((chunk, a.micro))
            if rank != r:                                # the turn of the V is no message
                ops[r].append(P2P(Op.SEND_NEXT if is_act else Op.SEND_PREV, a.chunk, a.micro))
                ops[rank].append(P2P(Op.RECV_PREV if is_act else Op.RECV_NEXT, chunk, a.micro))
        for r in range(pp):
            lists[r] += batch(*ops[r])
    return lists


zb_v.stage_shape = V


def _destination(a: Compute, r: int, pp: int) -> tuple[int, int] | None:
    """(rank, chunk) that needs the tensor compute ``a`` produced, or None (the loss, the embedding's
    input gradient, or a W)."""
    if a.kind is Kind.BACKWARD_WEIGHT:
        return None
    vs = virtual_stage(r, pp, a.chunk, V) + (1 if a.kind is Kind.FORWARD else -1)
    return stage_position(vs, pp, V) if 0 <= vs < 2 * pp else None


class _RankState:
    """What one rank has done and holds at the start of a step of :func:`zb_v`'s lockstep."""

    def __init__(self, r: int, pp: int, m: int, forward_only: bool):
        self.r, self.pp, self.m, self.fo = r, pp, m, forward_only
        self.next_f, self.next_i = [0, 0], [0, 0]
        self.held = 0                                 # chunk sets from F to W
        self.pending_w: list[tuple[int, int]] = []
        self.acts: set[tuple[int, int]] = set()      # (chunk, micro-batch) inputs arrived, not used yet
        self.grads: set[tuple[int, int]] = set()

    @property
    def finished(self) -> bool:
        return self.next_f == [self.m] * 2 and (self.fo or (self.next_i == [self.m] * 2 and not self.pending_w))

    def pick(self) -> Compute | None:
        for c in (1, 0):
            f = self.next_f[c]
            first = c == 0 and self.r == 0
            if f < self.m and (first or (c, f) in self.acts) and (self.fo or self.held < 2 * self.pp):
                return Compute(Kind.FORWARD, c, f)
        if self.fo:
            return None
        for c in (0, 1):                             # chunk 0's I first: it unblocks the rank before
            i = self.next_i[c]
            last = c == 1 and self.r == 0
            if i < self.next_f[c] and (last or (c, i) in self.grads):
                return Compute(Kind.BACKWARD_INPUT, c, i)
        if self.pending_w:
            return Compute(Kind.BACKWARD_WEIGHT, *self.pending_w[0])
        return None

    def apply(self, a: Compute) -> None:
        key = (a.chunk, a.micro)
        if a.kind is Kind.FORWARD:
            self.acts.discard(key)
            self.next_f[a.chunk] += 1
            self.held += 0 if self.fo else 1
        elif a.kind is Kind.BACKWARD_INPUT:
            self.grads.discard(key)
            self.next_i[a.chunk] += 1
            self.pending_w.append(key)
        else:
            self.pending_w.pop(0)
            self.held -= 1
