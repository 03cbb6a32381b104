"""The collectives megazero's data-parallel and ZeRO code issues, each one recording its bytes.

Thin wrappers over :mod:`megazero.parallel.comm` (which holds the torch-version shims) that

* take ``async_op`` and return the work handle, so bucket reductions overlap backward;
* are a no-op at group size 1 (nothing is sent, nothing is counted); ``group=None`` means size 1,
  as everywhere in :mod:`~megazero.parallel.comm` -- pass ``dist.group.WORLD`` for the world;
* record into a :class:`CommLog`, keyed by a tag naming the group ("dp", "tp", "emb", "mp",
  "world"). The log is an explicit object handed to whoever issues collectives; there is no
  module-level counter.

Byte convention (per rank, bytes *sent*, ring algorithm, N = group size, S = bytes of the full tensor):

    all-reduce       2 (N-1)/N * S      (a ring reduce-scatter followed by a ring all-gather)
    reduce-scatter     (N-1)/N * S      (S = the full input; each rank ends with S/N)
    all-gather         (N-1)/N * S      (S = the full output; each rank starts with S/N)
    all-to-all         the rows sent to the other ranks (uneven splits: what this rank's split sizes say)

This is the accounting of the ZeRO paper: plain data parallelism moves 2 Psi (N-1)/N per rank per
step (one gradient all-reduce), ZeRO-1/2 move the same as reduce-scatter(grads) + all-gather(params).
It counts the algorithm's volume, not what a particular backend puts on the wire (gloo may pick a
different algorithm for small tensors).
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from megazero.parallel.comm import all_gather_flat, group_size, reduce_scatter_flat


class CommLog:
    """Bytes sent per rank by the collectives issued through this module, by tag.

        log = CommLog()
        all_reduce(t, group, log, "dp")
        log.bytes()            # {'dp': 2 * (N-1)/N * t.numel() * t.element_size()}
        log.reset()            # e.g. at the start of every step
    """

    def __init__(self) -> None:
        self._bytes: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)

    def record(self, tag: str, nbytes: float) -> None:
        self._bytes[tag] += nbytes
        self._calls[tag] += 1

    def bytes(self) -> dict[str, float]:
        """Bytes sent per rank since the last reset, by tag."""
        return dict(self._bytes)

    def calls(self) -> dict[str, int]:
        """Number of collectives since the last reset, by tag."""
        return dict(self._calls)

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group, log: CommLog | None, tag: str, *,
               op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``; returns the work handle when async."""
    n = group_size(group)
    if n == 1:
        return None
    if log is not None:
        log.record(tag, 2 * (n - 1) / n * _nbytes(tensor))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, log: CommLog | None, tag: str, *,
                   async_op: bool = False):
    """Sum ``input`` (N * output.numel() elements) over ``group``; rank r gets chunk r in ``output``.

    ``output`` may be rank r's chunk of ``input`` itself (in place; works on gloo and NCCL).
    """
    return _flat(reduce_scatter_flat, output, input, input, group, log, tag, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, log: CommLog | None, tag: str, *,
               async_op: bool = False):
    """Concatenate every rank's ``input`` into ``output`` (N * input.numel() elements), in rank order.

    ``input`` may be rank r's chunk of ``output`` itself (in place).
    """
    return _flat(all_gather_flat, output, input, output, group, log, tag, async_op)


def _flat(collective, output, input, full, group, log: CommLog | None, tag: str, async_op: bool):
    """Run a flat collective whose full-size side is ``full``: (N-1)/N of it crosses the wire per rank."""
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    if log is not None:
        log.record(tag, (n - 1) / n * _nbytes(full))
    return collective(output, input, group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group, log: CommLog | None, tag: str) -> None:
    """``all_to_all_single`` with uneven splits along dim 0: rows ``input_splits[j]`` go to group rank j,
    ``output_splits[j]`` rows arrive from it. Records the bytes of the rows sent to the other ranks."""
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return
    if log is not None:
        me = dist.get_rank(group)
        row = math.prod(input.shape[1:]) * input.element_size()          # bytes of one row (0 rows is fine)
        log.record(tag, sum(c for j, c in enumerate(input_splits) if j != me) * row)
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
