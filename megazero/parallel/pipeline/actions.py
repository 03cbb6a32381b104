"""A pipeline schedule as data: for each pipeline rank, the ordered list of what it does in one step.

Two kinds of action make up a rank's list:

- :class:`Compute`: forward ``F``, full backward ``B``, or (for zero-bubble schedules) the
  input-gradient half ``I`` and the weight-gradient half ``W`` of a backward, of one micro-batch
  through one of the rank's model chunks.
- :class:`Exchange`: one batch of point-to-point operations with the neighbouring ranks (one
  ``torch.distributed.batch_isend_irecv``). Each :class:`P2P` names the tensor it carries: the
  activation of (chunk, micro-batch) sent to the next stage or received from the previous one, or
  the gradient sent to the previous stage or received from the next one. A batch holds at most one
  operation of each of the four kinds per chunk, in the fixed order send-next, recv-prev, send-prev,
  recv-next (``p2p.StageComm``'s order; on a ring of two ranks, where prev and next are the same
  rank, it is what makes both sides match the activation before the gradient), chunk by chunk
  within a kind (in the V shape one batch may receive chunk 0's activation from the previous rank
  and chunk 1's from the next).
  ``wait=False`` posts the receives and waits for each only when its tensor is needed (the
  interleaved schedule: a forward starts as soon as its activation is in while the gradient of the
  same batch still travels).

"Next" and "previous" are virtual stages (``partition.py``). In the loop shape chunk ``c`` of
pipeline rank ``r`` is virtual stage ``c * pp + r``: the activation of a chunk goes to the next
virtual stage, which is on the next rank (rank 0's chunk ``c + 1`` after the last rank's chunk
``c``), and its gradient comes back from there. In the V shape an odd chunk's next stage is on the
previous rank, and the turn (the last rank's chunk 0 to its chunk 1) is no message at all: the
executor hands the tensor over locally.

Example, 1F1B on the last of two ranks, micro-batches 0 and 1::

    [Exchange((P2P(RECV_PREV, 0, 0),)), Compute(FORWARD, 0, 0), Compute(BACKWARD, 0, 0),
     Exchange((P2P(RECV_PREV, 0, 1), P2P(SEND_PREV, 0, 0))), Compute(FORWARD, 0, 1), ...]

``generators.py`` builds such lists, ``simulate.py`` checks and draws them, ``executor.py`` runs one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """What a :class:`Compute` does; the value is its letter in pictures and messages."""

    FORWARD = "F"
    BACKWARD = "B"            # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"      # zero-bubble B: the input gradient only (to send back early)
    BACKWARD_WEIGHT = "W"     # zero-bubble W: the deferred weight gradients


class Op(enum.Enum):
    """The four point-to-point operations, in the order a batch posts them."""

    SEND_NEXT = 0             # this chunk's output activation, to the next virtual stage
    RECV_PREV = 1             # this chunk's input activation, from the previous virtual stage
    SEND_PREV = 2             # the gradient of this chunk's input, to the previous virtual stage
    RECV_NEXT = 3             # the gradient of this chunk's output, from the next virtual stage

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def tensor(self) -> str:
        """'activation' or 'gradient'."""
        return "activation" if self in _ACTIVATIONS else "gradient"

    @property
    def towards_next(self) -> bool:
        """True when the peer is the next pipeline rank."""
        return self in _TOWARDS_NEXT


_SENDS = frozenset({Op.SEND_NEXT, Op.SEND_PREV})
_ACTIVATIONS = frozenset({Op.SEND_NEXT, Op.RECV_PREV})
_TOWARDS_NEXT = frozenset({Op.SEND_NEXT, Op.RECV_NEXT})


@dataclass(frozen=True)
class Compute:
    """Forward or (part of a) backward of micro-batch ``micro`` through model chunk ``chunk``."""

    kind: Kind
    chunk: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind.value}(chunk {self.chunk}, micro-batch {self.micro})"


@dataclass(frozen=True)
class P2P:
    """One send or receive of the activation (or gradient) of micro-batch ``micro`` of this rank's
    chunk ``chunk``: the chunk's output or input gradient for a send, its input or output gradient
    for a receive."""

    op: Op
    chunk: int
    micro: int

    def __str__(self) -> str:
        verb = "send" if self.op.is_send else "recv"
        peer = "next" if self.op.towards_next else "prev"
        return f"{verb}-{peer} {self.op.tensor} (chunk {self.chunk}, micro-batch {self.micro})"


@dataclass(frozen=True)
class Exchange:
    """One batch of p2p operations (``batch_isend_irecv``); see the module docstring for the rules."""

    ops: tuple[P2P, ...]
    wait: bool = True

    def __post_init__(self):
        keys = [(p.op.value, p.chunk) for p in self.ops]
        if not self.ops or keys != sorted(set(keys)):
            raise ValueError(f"an Exchange holds p2p ops, at most one of each kind per chunk, in the order "
                             f"send-next, recv-prev, send-prev, recv-next (chunk by chunk within a kind); "
                             f"got {[str(p) for p in self.ops]}")

    def __str__(self) -> str:
        return "exchange[" + ", ".join(str(p) for p in self.ops) + ("" if self.wait else "; wait when needed") + "]"


Action = Compute | Exchange


def F(chunk: int, micro: int) -> Compute:
    return Compute(Kind.FORWARD, chunk, micro)


def B(chunk: int, micro: int) -> Compute:
    return Compute(Kind.BACKWARD, chunk, micro)


def batch(*ops: P2P | None, wait: bool = True) -> list[Exchange]:
    """The batch of the given ops (``None`` entries skipped) put in posting order, as a list of one
    Exchange, or an empty list when no op is left: generators write ``acts += batch(...)``."""
    ops = tuple(sorted((p for p in ops if p is not None), key=lambda p: (p.op.value, p.chunk)))
    return [Exchange(ops, wait)] if ops else []
