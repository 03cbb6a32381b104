"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters") as a schedule generator: each rank holds v model chunks, so a micro-batch crosses every
rank v times.

Order of work on a rank. Its m*v forwards run in groups of pp micro-batches per chunk: with pp=2,
v=2, m=4 the forward sequence k = 0..7 is::

    k:      0   1   2   3   4   5   6   7
    chunk:  0   0   1   1   0   0   1   1        chunk_of(k) = (k mod pp*v) // pp
    micro:  0   1   0   1   2   3   2   3        micro_of(k): each chunk takes its micro-batches in order

Backwards walk the chunks in reverse (chunk v-1 first). Warmup is ``2 * (pp - r - 1) + (v - 1) * pp``
forwards (all of them when m == pp), then one forward + one backward per step, then the remaining
backwards. That keeps each rank busy while the first micro-batch travels the v*pp virtual stages.

What a receive carries. Activations arrive from the previous rank in the order that rank sent
them, so the n-th one received belongs to the chunk the n-th send was for (chunk c on rank r-1
feeds chunk c on rank r; the last rank's chunk c feeds chunk c+1 on rank 0); gradients likewise
from the next rank. :func:`_arrivals` lists them ahead of time, so every receive in the list names
its (chunk, micro-batch).

When to receive. A receive must sit in the same batch as the neighbour's matching send (otherwise
both block). On middle ranks every step sends and receives; the first rank gets nothing while the
last rank finishes chunk v-1 (no send) and the last rank gets no gradient while the first rank runs
chunk 0's backwards. In the steady phase, at the batch where the first rank receives from the last,
the first rank has run forward k and the last rank is sending forward k - (pp - 1) (the first rank
is pp-1 forwards ahead); likewise the last rank is pp-1 backwards ahead of the first. So each end
decides with index ``k - (pp - 1)`` whether the other end is sending. Every batch posts its receives
and waits for each only when its tensor is needed (``Exchange(wait=False)``), so a forward never
waits for a gradient that travels in the same batch as its activation (Megatron's
``--overlap-p2p-communication``). ``simulate.py`` checks all of this for many pp, v, m.
"""
from __future__ import annotations

from collections import deque

from megazero.config import FLAG
from megazero.parallel.pipeline.actions import P2P, Action, B, F, Op, batch


def chunk_of(k: int, pp: int, v: int, forward: bool = True) -> int:
    """Model chunk of this rank's k-th forward (or backward) in the interleaved order."""
    c = (k % (pp * v)) // pp
    return c if forward else v - 1 - c


def micro_of(k: int, pp: int, v: int) -> int:
    """Micro-batch of this rank's k-th forward (or backward) in the interleaved order."""
    return (k // (pp * v)) * pp + k % pp


def interleaved_warmup(m: int, pp: int, pp_rank: int, v: int, forward_only: bool = False) -> int:
    """Forwards run before the first backward on pipeline rank ``pp_rank``."""
    total = m * v
    if forward_only or m == pp:
        return total
    return min(2 * (pp - pp_rank - 1) + (v - 1) * pp, total)


def _arrivals(m: int, pp: int, r: int, v: int) -> tuple[deque, deque]:
    """(chunk, micro-batch) of the successive activations (from prev) and gradients (from next)
    that rank r receives."""
    prev, nxt = (r - 1) % pp, (r + 1) % pp
    acts, grads = deque(), deque()
    for k in range(m * v):
        c, i = chunk_of(k, pp, v, forward=True), micro_of(k, pp, v)
        if not (prev == pp - 1 and c == v - 1):          # the last virtual stage sends nothing
            acts.append((c + 1 if r == 0 else c, i))
        c = chunk_of(k, pp, v, forward=False)
        if not (nxt == 0 and c == 0):                    # the first virtual stage sends nothing
            grads.append((c - 1 if r == pp - 1 else c, i))
    return acts, grads


def interleaved_one_f_one_b(pp: int, m: int, v: int, forward_only: bool = False) -> list[list[Action]]:
    """Interleaved 1F1B over v chunks per rank (the p2p wraps around: last rank -> rank 0)."""
    if m % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) divisible by pp ({pp}): "
                         f"make {FLAG.global_batch_size} a multiple of pp * micro-batch * dp")
    return [_interleaved_rank(pp, m, v, r, forward_only) for r in range(pp)]


def _interleaved_rank(pp: int, m: int, v: int, r: int, fwd_only: bool) -> list[Action]:
    total = m * v
    warmup = interleaved_warmup(m, pp, r, v, fwd_only)
    steady = total - warmup
    act_in, grad_in = _arrivals(m, pp, r, v)
    out: list[Action] = []

    def fwd(k):                                  # the forward and the send of its output (if any)
        c, i = chunk_of(k, pp, v), micro_of(k, pp, v)
        out.append(F(c, i))
        return None if (r == pp - 1 and c == v - 1) else P2P(Op.SEND_NEXT, c, i)

    def bwd(k):                                  # the backward and the send of its input gradient
        c, i = chunk_of(k, pp, v, forward=False), micro_of(k, pp, v)
        out.append(B(c, i))
        return None if (r == 0 and c == 0) else P2P(Op.SEND_PREV, c, i)

    def exchange(*sends, recv_prev=False, recv_next=False):
        out.extend(batch(*sends, P2P(Op.RECV_PREV, *act_in.popleft()) if recv_prev else None,
                         P2P(Op.RECV_NEXT, *grad_in.popleft()) if recv_next else None, wait=False))

    if r != 0:
        exchange(recv_prev=True)
    for k in range(warmup):                                    # warmup: forwards only
        send = fwd(k)
        exchange(send, recv_prev=k != total - 1 and not (r == 0 and chunk_of(k + 1, pp, v) == 0),
                 recv_next=k == warmup - 1 and steady > 0 and r != pp - 1)

    for k in range(steady):                                    # steady: 1F1B
        send_act, send_grad = fwd(k + warmup), bwd(k)
        lag_f, lag_b = k + warmup - (pp - 1), k - (pp - 1)
        recv_prev = r != 0 or chunk_of(lag_f, pp, v) != v - 1
        recv_next = r != pp - 1 or (lag_b >= 0 and chunk_of(lag_b, pp, v, forward=False) != 0)
        exchange(send_act, send_grad, recv_prev=recv_prev and k != steady - 1, recv_next=recv_next)

    if fwd_only:
        return out
    if steady == 0 and r != pp - 1:                            # all-warmup: fetch the first gradient
        exchange(recv_next=True)
    for k in range(steady, total):                             # cooldown: backwards only
        send = bwd(k)
        exchange(send, recv_next=k != total - 1 and
                 not (r == pp - 1 and chunk_of(k + 1, pp, v, forward=False) == v - 1))
    return out
