"""ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism") as a schedule generator.

Each backward is split into ``I`` (the input gradient, which the previous stage waits for) and ``W``
(the weight gradients, which nobody waits for: ``split_backward.py``). ZB-H1 is the paper's
memory-efficient schedule: 1F1B's warm-up and steady F/I alternation, with each rank's W's delayed
into the slots where 1F1B's ranks wait for a gradient in the cooldown. Memory: counted from a
forward to its I (the whole activation set a backward needs) rank r holds at most ``pp - r``
micro-batches, 1F1B's per-rank peak; counted from a forward to its W (what stays held for the weight
gradients: the layers' inputs) every rank holds at most ``pp`` -- r more than 1F1B's on rank r, kept for
their W -- which is 1F1B's peak on rank 0, the paper's "same peak memory as 1F1B".

Bubble. With F = I = W = 1 time unit (1F1B's full backward B = I + W = 2), the paper's ZB-H1 runs a
step in ``3m + pp - 1`` units against 1F1B's ``3(m + pp - 1)``: bubble ``(pp-1)/(3m+pp-1)`` against
``(pp-1)/(m+pp-1)``, a third for m >> pp. These lists reach the formula exactly for every m >= pp
(``simulate``, tested for pp 2-8): 3/27 = 0.111 at pp 4, m 8 (1F1B: 0.273). For m < pp there is no
steady phase and the bubble is larger than the formula, still below 1F1B's.

How the lists are written. Time runs in unit steps, all ranks in lockstep. At each step every rank
picks one compute from what it has at the start of the step: the next F if its activation has arrived
and the memory bounds above allow it, else the next I if its output gradient has arrived (the last
stage: once its forward ran), else the oldest pending W, else nothing. After the step, each rank
posts one batch: the tensor it just computed goes to its neighbour, and it receives what its
neighbours just computed. Each batch is matched by the neighbours' batches of the same step and
waits only on tensors computed at or before that step, so no rank can wait on one that waits on it:
the lists are deadlock-free by construction, and ``simulate.py`` checks them anyway (tests: pp 2-8,
m 1-16). pp = 4, m = 8 (``simulate.render``, one unit per F, I, W)::

    rank 0: F0 F1 F2 F3 .. .. .. I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
    rank 1: .. F0 F1 F2 .. .. I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7
    rank 2: .. .. F0 F1 .. I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7
    rank 3: .. .. .. F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7

(the exact picture, beside 1F1B's, is in docs/parallelism.md).
"""
from __future__ import annotations

from megazero.config import FLAG
from megazero.parallel.pipeline.actions import P2P, Action, Compute, Kind, Op, batch
from megazero.parallel.pipeline.executor import stage_shape_of
from megazero.parallel.pipeline.simulate import simulate


def zb_h1(pp: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """ZB-H1 over one chunk per rank (see the module docstring)."""
    if v != 1:
        raise ValueError(f"the zb-h1 schedule runs one model chunk per rank, got {v}: drop "
                         f"{FLAG.num_layers_per_virtual_pipeline_stage}")
    ranks = [_RankState(r, pp, m, forward_only) for r in range(pp)]
    lists: list[list[Action]] = [[] for _ in range(pp)]
    while not all(st.finished for st in ranks):
        picked = [st.pick() for st in ranks]
        for r, (st, a) in enumerate(zip(ranks, picked)):
            if a is not None:
                lists[r].append(a)
                st.apply(a)
        for r, st in enumerate(ranks):                  # the step's messages, one batch per rank
            sent_act = _produced(picked[r], Kind.FORWARD, r != pp - 1)
            sent_grad = _produced(picked[r], Kind.BACKWARD_INPUT, r != 0)
            got_act = _produced(picked[r - 1], Kind.FORWARD, True) if r > 0 else None
            got_grad = _produced(picked[r + 1], Kind.BACKWARD_INPUT, True) if r < pp - 1 else None
            if got_act is not None:
                st.acts.add(got_act)
            if got_grad is not None:
                st.grads.add(got_grad)
            lists[r] += batch(_p2p(Op.SEND_NEXT, sent_act), _p2p(Op.RECV_PREV, got_act),
                              _p2p(Op.SEND_PREV, sent_grad), _p2p(Op.RECV_NEXT, got_grad))
    return lists


class _RankState:
    """What one rank has done and holds at the start of a step of :func:`zb_h1`'s lockstep."""
    def __init__(self, r: int, pp: int, m: int, forward_only: bool):
        self.r, self.pp, self.m, self.fo = r, pp, m, forward_only
        self.first, self.last = r == 0, r == pp - 1
        self.next_f = self.next_i = self.held = 0
        self.pending_w: list[int] = []
        self.acts: set[int] = set()                   # activations arrived and not used yet
        self.grads: set[int] = set()

    @property
    def finished(self) -> bool:
        return self.next_f == self.m and (self.fo or (self.next_i == self.m and not self.pending_w))

    def pick(self) -> Compute | None:
        i, f = self.next_i, self.next_f
        can_i = not self.fo and i < f and (self.last or i in self.grads)
        can_f = f < self.m and (self.first or f in self.acts) and (
            self.fo or (self.held < self.pp and f - i < self.pp - self.r))
        if can_f:
            return Compute(Kind.FORWARD, 0, f)
        if can_i:
            return Compute(Kind.BACKWARD_INPUT, 0, i)
        if self.pending_w:
            return Compute(Kind.BACKWARD_WEIGHT, 0, self.pending_w[0])
        return None

    def apply(self, a: Compute) -> None:
        if a.kind is Kind.FORWARD:
            self.acts.discard(a.micro)
            self.next_f += 1
            self.held += 0 if self.fo else 1
        elif a.kind is Kind.BACKWARD_INPUT:
            self.grads.discard(a.micro)
            self.next_i += 1
            self.pending_w.append(a.micro)
        else:
            self.pending_w.pop(0)
            self.held -= 1


def _produced(a: Compute | None, kind: Kind, sends: bool) -> int | None:
    """The micro-batch whose tensor compute ``a`` hands to a neighbour, if it is of ``kind``."""
    return a.micro if a is not None and sends and a.kind is kind else None


def _p2p(op: Op, micro: int | None) -> P2P | None:
    return None if micro is None else P2P(op, 0, micro)


UNIT_COSTS = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.0}


def theory(generator, pp: int, m: int, v: int = 1, durations=None):
    """The (bubble fraction, peak in-flight micro-batches per rank, counted from F to its B or W) a
    schedule predicts, from the simulator with F = I = W = 1 and a full backward B = 2 units (so 1F1B
    and ZB-H1 compare; what a run prints at start), or with ``durations``: measured costs, one dict
    per rank ({Kind: seconds}; the zero-bubble paper's bubble from profiled T_F, T_B, T_W, where
    the input-gradient half costs more than the weight half and the last stage more than the others)."""
    costs = UNIT_COSTS if durations is None else durations
    tl = simulate(generator(pp, m, v, False), m, v, False, costs, stage_shape_of(generator))
    return tl.bubble_fraction, tl.peak_in_flight
