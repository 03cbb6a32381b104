"""The collectives megazero's data-parallel and ZeRO code issues, each one recording its bytes.

Call these (not :mod:`megazero.parallel.raw_comm`, which they wrap) for any traffic of model state. They

* take ``async_op`` and return the work handle, so bucket reductions overlap backward;
* are a no-op at group size 1 (nothing is sent, nothing is counted); ``group=None`` means size 1,
  as everywhere in :mod:`~megazero.parallel.raw_comm` -- pass ``dist.group.WORLD`` for the world;
* record into a :class:`CommLog`, keyed by a tag naming the group ("dp", "tp", "emb", "mp",
  "world"). The log is an explicit object handed to whoever issues collectives; there is no
  module-level counter.

Byte convention (per rank, bytes *sent*, ring algorithm, N = group size, S = bytes of the full tensor):

    all-reduce       2 (N-1)/N * S      (a ring reduce-scatter followed by a ring all-gather)
    reduce-scatter     (N-1)/N * S      (S = the full input; each rank ends with S/N)
    all-gather         (N-1)/N * S      (S = the full output; each rank starts with S/N)
    all-to-all         (N-1)/N * S      (S = the full input; rank r sends chunk j to group rank j; with
                                         uneven splits, the rows this rank sends to the other ranks)

This is the accounting of the ZeRO paper: plain data parallelism moves 2 Psi (N-1)/N per rank per
step (one gradient all-reduce), ZeRO-1/2 move the same as reduce-scatter(grads) + all-gather(params).
It counts the algorithm's volume, not what a particular backend puts on the wire (gloo may pick a
different algorithm for small tensors).

Intra-node and inter-node bytes. When the log knows the nodes (``CommLog(ranks_per_node=L)``: global
rank g is on node g // L), every record is also split by link. Convention: per rank, *averaged over
the group's ranks*, so that N times the figure is the traffic the group puts on each kind of link.

    ring (all-reduce, reduce-scatter, all-gather): the N ranks in group-rank order form a ring; each
        rank sends its B bytes to the next. With c of the N ring edges joining different nodes
        (c = number of nodes the group spans, when the group is sorted by node and spans more
        than one), inter = B * c / N and intra = B * (N - c) / N.
    all-to-all: rank i sends S/N to each other member j; inter = S/N * (pairs (i, j), i != j, on
        different nodes) / N, intra the rest of (N-1)/N * S.

Example, all-gather of S bytes over dp = 8 on 2 nodes of 4: B = 7/8 S, c = 2: inter = 7/32 S per
rank; an all-to-all of S bytes over the same group: inter = S/8 * (8*4)/8 = S/2, intra = 3/8 S.
A group inside one node has inter = 0.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from megazero.parallel.raw_comm import all_gather_into, group_size, reduce_scatter_into


class CommLog:
    """Bytes sent per rank by the collectives issued through this module, by tag.

        log = CommLog()
        all_reduce(t, group, log, "dp")
        log.bytes()            # {'dp': 2 * (N-1)/N * t.numel() * t.element_size()}
        log.reset()            # e.g. at the start of every step
    """

    def __init__(self, ranks_per_node: int | None = None) -> None:
        self._bytes: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)
        self._links: dict[str, float] = defaultdict(float)
        self.ranks_per_node = ranks_per_node       # None: every rank on one node (all bytes intra)
        self._inter_share: dict[tuple, tuple[float, float]] = {}

    def record(self, tag: str, nbytes: float, group=None, kind: str = "ring") -> None:
        """Add ``nbytes`` sent per rank under ``tag``; with the group, also split them by link."""
        self._bytes[tag] += nbytes
        self._calls[tag] += 1
        inter = nbytes * self._inter_fraction(group, kind) if group is not None else 0.0
        self._links["inter"] += inter
        self._links["intra"] += nbytes - inter

    def _inter_fraction(self, group, kind: str) -> float:
        """Share of a collective's bytes that crosses nodes (the module docstring's convention)."""
        if not self.ranks_per_node:
            return 0.0
        ranks = tuple(dist.get_process_group_ranks(group))
        key = (ranks, kind)
        if key not in self._inter_share:
            self._inter_share[key] = inter_fraction([r // self.ranks_per_node for r in ranks], kind)
        return self._inter_share[key]

    def link_bytes(self) -> dict[str, float]:
        """Bytes sent per rank since the last reset, by link: {'intra': ..., 'inter': ...}."""
        return {"intra": self._links["intra"], "inter": self._links["inter"]}

    def bytes(self) -> dict[str, float]:
        """Bytes sent per rank since the last reset, by tag."""
        return dict(self._bytes)

    def calls(self) -> dict[str, int]:
        """Number of collectives since the last reset, by tag."""
        return dict(self._calls)

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()
        self._links.clear()


def inter_fraction(nodes: list[int], kind: str = "ring") -> float:
    """Share of the bytes a collective sends per rank that crosses nodes, for a group whose members,
    in group-rank order, sit on ``nodes`` (pure; the module docstring's convention)::

        inter_fraction([0, 0, 0, 0, 1, 1, 1, 1], "ring")        == 2 / 8
        inter_fraction([0, 0, 0, 0, 1, 1, 1, 1], "all_to_all")  == 32 / 56  (of (N-1)/N * S)
    """
    n = len(nodes)
    if n < 2:
        return 0.0
    if kind == "ring":
        return sum(nodes[i] != nodes[(i + 1) % n] for i in range(n)) / n
    if kind == "all_to_all":
        return sum(a != b for a in nodes for b in nodes) / (n * (n - 1))
    raise ValueError(f"unknown collective kind {kind!r}: ring or all_to_all")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group, log: CommLog | None, tag: str, *,
               op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``; returns the work handle when async."""
    n = group_size(group)
    if n == 1:
        return None
    if log is not None:
        log.record(tag, 2 * (n - 1) / n * _nbytes(tensor), group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, log: CommLog | None, tag: str, *,
                   async_op: bool = False, input_is_scratch: bool = False, inbox: bool = False):
    """Sum ``input`` (N * output.numel() elements) over ``group``; rank r gets chunk r in ``output``.

    ``output`` may be rank r's chunk of ``input`` itself (in place; works on gloo and NCCL).
    ``input_is_scratch``: the caller reads no other chunk of ``input`` afterwards, so the backend may
    overwrite it; ``inbox``: the caller bounds the reductions in flight, so each may hold a temporary
    (N-2)/N of ``input`` (:func:`megazero.parallel.raw_comm.reduce_scatter_into`; counted as a reduce-scatter).
    """
    def collective(out, inp, group, async_op):
        return reduce_scatter_into(out, inp, group, async_op, input_is_scratch=input_is_scratch, inbox=inbox)
    return _flat(collective, output, input, input, group, log, tag, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, log: CommLog | None, tag: str, *,
               async_op: bool = False):
    """Concatenate every rank's ``input`` into ``output`` (N * input.numel() elements), in rank order.

    ``input`` may be rank r's chunk of ``output`` itself (in place).
    """
    return _flat(all_gather_into, output, input, output, group, log, tag, async_op)


def _flat(collective, output, input, full, group, log: CommLog | None, tag: str, async_op: bool):
    """Run a flat collective whose full-size side is ``full``: (N-1)/N of it crosses the wire per rank."""
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    if log is not None:
        log.record(tag, (n - 1) / n * _nbytes(full), group)
    return collective(output, input, group, async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group, log: CommLog | None, tag: str, *,
               output_splits: list[int] | None = None, input_splits: list[int] | None = None, async_op: bool = False):
    """Rank i sends chunk j of ``input`` (along dim 0) to group rank j, which stores it as chunk i of
    ``output``: N equal chunks, or ``input_splits[j]`` rows to rank j and ``output_splits[j]`` rows from
    it (uneven; the caller exchanges the counts first). Records the bytes sent to the other ranks (with
    uneven splits their intra/inter share is that of an even exchange over the same group)."""
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    if log is not None:
        if input_splits is None:
            sent = (n - 1) / n * _nbytes(input)
        else:
            me = dist.get_rank(group)
            row = math.prod(input.shape[1:]) * input.element_size()          # bytes of one row (0 rows is fine)
            sent = sum(c for j, c in enumerate(input_splits) if j != me) * row
        log.record(tag, sent, group, "all_to_all")
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)
