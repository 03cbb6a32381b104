"""Point-to-point exchange of activations (forward) and their gradients (backward) between stages.

Every exchange is one batch of ``isend`` / ``irecv`` (``torch.distributed.batch_isend_irecv``). The
sends are never waited on: a stage goes on computing while its outputs travel (``flush()``, called
by ``run_schedule`` at the end of the step, waits for what is still in flight, and completed sends
are dropped at every exchange). The receives are waited on before returning, or, with
``wait=False``, handed back as :class:`Incoming` and waited on only when the tensor is needed: the
interleaved schedule receives the next forward's activation and the next backward's gradient in
one batch, and starts the forward as soon as its activation is in, while the gradient still travels
(Megatron's ``--overlap-p2p-communication``). There is no barrier and no device synchronize. The
receive buffers are allocated from the known activation shape (``[s(/tp), b, h]``) and the model's
dtype, so no shape metadata travels.

Who talks to whom, pp=4 with tp=2 (rank = tp_rank + 2 * pp_rank, Megatron's order)::

    tp rank 0:  0 -> 2 -> 4 -> 6        activations go right, gradients go left
    tp rank 1:  1 -> 3 -> 5 -> 7        (each tp rank talks to the same tp rank of its neighbours)

With ``ring=True`` (interleaved schedule) the last stage's next rank is the first stage and vice
versa (6 -> 0 above): the output of chunk c on the last stage feeds chunk c+1 on the first.

Ordering rule. A send and a receive are matched by their order between a pair of ranks (NCCL
ignores tags, and we use one tag on gloo too so CPU tests see the same matching). Every batch posts
its operations in the same order -- send-next, recv-prev, send-prev, recv-next -- so when two ranks
are each other's prev *and* next (pp=2 ring) the activation is always matched before the gradient
on both sides. Deadlock freedom comes from the schedules: each batch on one rank meets a batch on
its neighbour containing the matching operations (both backends only complete a send once the peer
has posted the receive).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megazero.config import FLAG
from megazero.parallel.groups import PipelineLayout


class Incoming:
    """A receive that has been posted: ``get()`` waits for it (once) and returns the tensor."""

    __slots__ = ("tensor", "_reqs", "_comm")

    def __init__(self, tensor: torch.Tensor, reqs: list, comm: "StageComm"):
        self.tensor, self._reqs, self._comm = tensor, reqs, comm

    def get(self) -> torch.Tensor:
        self._comm.wait_for(self._reqs)
        self._reqs = []
        return self.tensor


class StageComm:
    """Batched p2p between this rank and its pipeline neighbours for one activation shape.

    ``shape``/``dtype``: the tensor every stage boundary carries (see
    the model's ``activation_shape``). Methods return ``None`` for a
    direction with no peer (the first stage's ``recv_forward`` without ``ring``, ...).
    ``num_batches`` / ``num_messages`` count what was exchanged (cheap instrumentation).
    ``time_waits``: also add up in ``wait_s`` the seconds spent waiting for receives and, at
    :meth:`flush`, for sends: this rank's idle time in the step, the measured bubble (``None``,
    and no clock read, when off).
    """

    def __init__(self, pipeline: PipelineLayout, shape, dtype: torch.dtype, *, ring: bool = False,
                 time_waits: bool = False):
        self.shape, self.dtype, self.device = tuple(shape), dtype, pipeline.device
        self.group = pipeline.group
        p, r = pipeline.size, pipeline.rank
        if ring and p > 1:
            self.prev, self.next = pipeline.ranks[(r - 1) % p], pipeline.ranks[(r + 1) % p]
        else:
            self.prev, self.next = pipeline.prev_rank, pipeline.next_rank
        self.num_batches = self.num_messages = 0
        self.wait_s: float | None = 0.0 if time_waits else None
        self._sends: list = []       # (request, tensor) of sends not yet seen complete

    def wait_for(self, reqs) -> None:
        """Wait for the requests ``reqs``, timed into ``wait_s`` when waits are timed."""
        if self.wait_s is None:
            for req in reqs:
                req.wait()
            return
        t0 = time.perf_counter()
        for req in reqs:
            req.wait()
        self.wait_s += time.perf_counter() - t0

    def exchange(self, *, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                 recv_prev: bool = False, recv_next: bool = False, wait: bool = True):
        """One batch: optionally send to next / prev and receive from prev / next.

        Returns ``(from_prev, from_next)``; each is a fresh tensor (an :class:`Incoming` with
        ``wait=False``) or ``None`` when not received. A send or receive towards a missing
        neighbour (``None`` rank) is skipped.
        """
        ops, from_prev, from_next = [], None, None
        if send_next is not None and self.next is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_next, "send_next"), self.next, self.group))
        if recv_prev and self.prev is not None:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev, self.group))
        if send_prev is not None and self.prev is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_prev, "send_prev"), self.prev, self.group))
        if recv_next and self.next is not None:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next, self.group))
        if ops:
            reqs = dist.batch_isend_irecv(ops)
            recv_reqs = {}                            # received tensor's id -> what completes it
            if len(reqs) != len(ops):                 # coalesced into fewer handles: all of them
                recv_reqs = {id(op.tensor): list(reqs) for op in ops if op.op is dist.irecv}
                self._sends += [(req, [op.tensor for op in ops]) for req in reqs]
            else:
                for op, req in zip(ops, reqs):
                    if op.op is dist.irecv:
                        recv_reqs[id(op.tensor)] = [req]
                    else:                             # keep the tensor alive until the send completes
                        self._sends.append((req, op.tensor))
            self._sends = [(req, t) for req, t in self._sends if not req.is_completed()]
            self.num_batches += 1
            self.num_messages += len(ops)
            from_prev, from_next = (None if t is None else Incoming(t, recv_reqs[id(t)], self)
                                    for t in (from_prev, from_next))
            if wait:
                from_prev, from_next = (None if x is None else x.get() for x in (from_prev, from_next))
        return from_prev, from_next

    def flush(self) -> None:
        """Wait for every send still in flight (end of a step: nothing may outlive it)."""
        self.wait_for([req for req, _ in self._sends])
        self._sends = []

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(f"pipeline {what}: tensor {tuple(t.shape)} {t.dtype} does not match the "
                               f"configured stage boundary {self.shape} {self.dtype}; check {FLAG.seq_length}, "
                               f"{FLAG.micro_batch_size}, {FLAG.hidden_size} and {FLAG.sequence_parallel}")
        return t.detach().contiguous()

    # Named exchanges, as the schedules use them (Megatron's vocabulary).
    def recv_forward(self):
        return self.exchange(recv_prev=True)[0]

    def send_forward(self, output):
        self.exchange(send_next=output)

    def recv_backward(self):
        return self.exchange(recv_next=True)[1]

    def send_backward(self, input_grad):
        self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        """1F1B steady state: hand the activation on, get the gradient of an earlier one back."""
        return self.exchange(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        """1F1B steady state: hand the gradient back, get the next micro-batch's activation."""
        return self.exchange(send_prev=input_grad, recv_prev=True)[0]
