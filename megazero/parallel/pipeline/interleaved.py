"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters"): each rank holds v model chunks, so a micro-batch crosses every rank v times.

Order of work on a rank. Its m*v forwards run in groups of pp micro-batches per chunk: with pp=2,
v=2, m=4 the forward sequence k = 0..7 is::

    k:      0   1   2   3   4   5   6   7
    chunk:  0   0   1   1   0   0   1   1        chunk_of(k) = (k mod pp*v) // pp
    micro:  0   1   0   1   2   3   2   3        (each chunk takes its micro-batches in order)

Backwards walk the chunks in reverse (chunk v-1 first). Warmup is ``2 * (pp - r - 1) + (v - 1) * pp``
forwards (all of them when m == pp), then one forward + one backward per step, then the remaining
backwards. That keeps each rank busy while the first micro-batch travels the v*pp virtual stages.

Where a received tensor goes. Activations arrive from the previous rank in the order that rank
sent them, so the n-th tensor received belongs to the chunk the n-th send was for (chunk c on rank
r-1 feeds chunk c on rank r; the last rank's chunk c feeds chunk c+1 on rank 0); gradients likewise
from the next rank. :func:`_arrival_chunks` lists those chunks ahead of time.

When to receive. A receive must sit in the same exchange as the neighbour's matching send
(otherwise both block). On middle ranks every step sends and receives; the first rank gets nothing
while the last rank finishes chunk v-1 (no send) and the last rank gets no gradient while the first
rank runs chunk 0's backwards. In the steady phase, at the exchange where the first rank receives
from the last, the first rank has run forward k and the last rank is sending forward k - (pp - 1)
(the first rank is pp-1 forwards ahead); likewise the last rank is pp-1 backwards ahead of the
first. So each end decides with index ``k - (pp - 1)`` whether the other end is sending.
(tests/pipeline_sim.py runs these rules under strict rendezvous semantics for many pp, v, m.)
"""
from __future__ import annotations

from collections import deque

from megazero.parallel.pipeline.p2p import StageComm
from megazero.parallel.pipeline.runner import StageRunner


def chunk_of(k: int, pp: int, v: int, forward: bool = True) -> int:
    """Model chunk of this rank's k-th forward (or backward) in the interleaved order."""
    c = (k % (pp * v)) // pp
    return c if forward else v - 1 - c


def interleaved_warmup(m: int, pp: int, pp_rank: int, v: int, forward_only: bool = False) -> int:
    """Forwards run before the first backward on pipeline rank ``pp_rank``."""
    total = m * v
    if forward_only or m == pp:
        return total
    return min(2 * (pp - pp_rank - 1) + (v - 1) * pp, total)


def _arrival_chunks(m: int, pp: int, r: int, v: int) -> tuple[deque, deque]:
    """Chunks that the successive activations (from prev) and gradients (from next) are for."""
    total, prev, nxt = m * v, (r - 1) % pp, (r + 1) % pp
    acts, grads = deque(), deque()
    for k in range(total):
        c = chunk_of(k, pp, v, forward=True)
        if not (prev == pp - 1 and c == v - 1):          # the last virtual stage sends nothing
            acts.append(c + 1 if r == 0 else c)
        c = chunk_of(k, pp, v, forward=False)
        if not (nxt == 0 and c == 0):                    # the first virtual stage sends nothing
            grads.append(c - 1 if r == pp - 1 else c)
    return acts, grads


class _Mailbox:
    """Received activations and gradients, filed per chunk in arrival order. They are filed as
    posted receives (``StageComm.exchange(wait=False)``) and waited on when taken out, so a forward
    never waits for a gradient that arrived in the same batch as its activation."""

    def __init__(self, m: int, pp: int, r: int, v: int):
        self.act_chunks, self.grad_chunks = _arrival_chunks(m, pp, r, v)
        self.acts = [deque() for _ in range(v)]
        self.grads = [deque() for _ in range(v)]

    def file(self, from_prev, from_next) -> None:
        if from_prev is not None:
            self.acts[self.act_chunks.popleft()].append(from_prev)
        if from_next is not None:
            self.grads[self.grad_chunks.popleft()].append(from_next)

    def take_act(self, c: int):
        return self.acts[c].popleft().get()

    def take_grad(self, c: int):
        return self.grads[c].popleft().get()

    def empty(self) -> bool:
        return not any(self.acts) and not any(self.grads)


def interleaved_one_f_one_b(runner: StageRunner, comm: StageComm) -> None:
    """Interleaved 1F1B over ``runner.v`` chunks; ``comm`` must be a ring (``StageComm(ring=True)``)."""
    pp, r, v, m = runner.pipeline.size, runner.pipeline.rank, runner.v, runner.num_micro
    if m % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) divisible by pp ({pp}): "
                         f"make --global-batch-size a multiple of pp * micro-batch * dp")
    total, fwd_only = m * v, runner.forward_only
    warmup = interleaved_warmup(m, pp, r, v, fwd_only)
    steady = total - warmup
    box = _Mailbox(m, pp, r, v)

    def forward(k):
        c = chunk_of(k, pp, v, forward=True)
        return runner.forward(c, None if runner.is_first(c) else box.take_act(c))

    def exchange(**ops):                                       # receives waited on when taken
        box.file(*comm.exchange(wait=False, **ops))

    def backward(k):
        c = chunk_of(k, pp, v, forward=False)
        return runner.backward(c, None if runner.is_last(c) else box.take_grad(c))

    if r != 0:
        exchange(recv_prev=True)
    for k in range(warmup):                                    # warmup: forwards only
        out = forward(k)
        recv_prev = k != total - 1 and not (r == 0 and chunk_of(k + 1, pp, v) == 0)
        recv_next = k == warmup - 1 and steady > 0 and r != pp - 1
        exchange(send_next=out, recv_prev=recv_prev, recv_next=recv_next)

    for k in range(steady):                                    # steady: 1F1B
        out, dx = forward(k + warmup), backward(k)
        lag_f, lag_b = k + warmup - (pp - 1), k - (pp - 1)
        recv_prev = r != 0 or chunk_of(lag_f, pp, v) != v - 1
        recv_next = r != pp - 1 or (lag_b >= 0 and chunk_of(lag_b, pp, v, forward=False) != 0)
        if k == steady - 1:
            recv_prev = False
        exchange(send_next=out, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next)

    if fwd_only:
        return
    if steady == 0 and r != pp - 1:                            # all-warmup: fetch the first gradient
        exchange(recv_next=True)
    for k in range(steady, total):                             # cooldown: backwards only
        dx = backward(k)
        recv_next = k != total - 1 and not (r == pp - 1 and chunk_of(k + 1, pp, v, forward=False) == v - 1)
        exchange(send_prev=dx, recv_next=recv_next)
    if not box.empty() or box.act_chunks or box.grad_chunks:
        raise RuntimeError("schedule bug: interleaved step ended with unconsumed or missing messages")
