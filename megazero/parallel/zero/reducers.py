"""How a sharded gradient bucket is summed over its data-parallel group: the reducer component of stages
2 and 3 (:class:`megazero.parallel.zero.sharded_grads.ShardedGradSync` takes one).

    reducer               flag                              wire, per rank           after it, rank r holds
    ReduceScatter         (default)                         (N-1)/N of the bucket    chunk r of the sum
    HierarchicalReducer   --zero-quantized-gradients (qgZ)  int8, node then nodes    chunk r of the sum

Both write chunk ``dp.rank`` of the sum into a separate ``target`` (the bucket's gradient shard, or a
scratch shard added to it), never average (the grad sync does), and say what transient memory they
hold while in flight (:meth:`inbox_bytes`), which the grad sync bounds and the memory estimator counts.
"""
from __future__ import annotations

import torch

from megazero.config import FLAG
from megazero.parallel import counted_comm as comm
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.groups import DataParallel
from megazero.parallel.raw_comm import group_size, reduce_scatter_inbox_bytes
from megazero.parallel.zero.quantize import pack_rows, unpack_rows


class ReduceScatter:
    """The bucket summed by a reduce-scatter, asynchronously. On gloo it runs as point-to-point messages
    that receive into a temporary inbox of (N-2)/N of the bucket (:mod:`megazero.parallel.raw_comm`), so
    the grad sync keeps a bounded number in flight."""

    def __init__(self, dp: DataParallel, comm_log: CommLog):
        self.dp, self.comm_log = dp, comm_log

    def reduce_into(self, target: torch.Tensor, grad: torch.Tensor):
        """Start ``target`` = chunk ``dp.rank`` of the sum of ``grad`` over dp; the work handle."""
        return comm.reduce_scatter(target, grad, self.dp.group, self.comm_log, self.dp.tag, async_op=True,
                                   input_is_scratch=True, inbox=True)

    @staticmethod
    def inbox_bytes(bucket_bytes: int, n: int, on_cuda: bool) -> int:
        """Transient bytes one reduction of a ``bucket_bytes`` bucket over ``n`` ranks holds in flight."""
        return reduce_scatter_inbox_bytes(bucket_bytes, n, on_cuda)


class HierarchicalReducer:
    """qgZ: sum a gradient bucket over dp with two quantized all-to-alls, ending in the same shard as a
    reduce-scatter (dp rank r holds chunk r of N). Synchronous: the sum is in ``target`` on return.

    The dp group has M nodes of L ranks, dp rank r = m L + l (node m, local position l; checked).
    Tensor slice reordering: the bucket [N c] is viewed as [M, L, c] and sent as rows [L, M c], row
    j to local rank j, so local rank l receives, from every node-mate, the chunks {m' L + l}.

        1. quantize rows, all-to-all inside the node, dequantize, sum  -> [M, c]: chunks m' L + l
        2. quantize rows, all-to-all across nodes (ranks at position l), dequantize, sum -> chunk m L + l

    Worked example, N = 4 (M = 2 nodes, L = 2), chunks g0..g3: dp rank 1 (m 0, l 1) sends
    [g0 g2] to rank 0 and keeps [g1 g3]; sums [g1 g3] over ranks {0, 1}; sends g3 to rank 3 (its peer
    on node 1), gets g1's node-1 partial from it; adds: the full g1. A stage with one rank is skipped
    (nothing quantized for it).
    """

    def __init__(self, dp: DataParallel, comm_log: CommLog, block: int):
        self.block, self.comm_log, self.tag = block, comm_log, dp.tag
        intra, inter = dp.intra, dp.inter
        self.local, self.nodes = (intra.size, inter.size) if intra and inter else (0, 0)
        node_start = (dp.rank // self.local) * self.local if self.local else 0
        if not self.local or self.local * self.nodes != dp.size or \
                intra.ranks != dp.ranks[node_start:node_start + self.local]:
            raise ValueError(f"{FLAG.zero_quantized_gradients} needs each data-parallel group split evenly over its "
                             f"nodes in blocks of consecutive ranks (group {list(dp.ranks)}, "
                             f"{dp.ranks_per_node} ranks per node): change {FLAG.ranks_per_node} or the layout")
        self.intra, self.inter = intra.group, inter.group

    def reduce_into(self, target: torch.Tensor, grad: torch.Tensor) -> None:
        """``target`` (c elements) = chunk dp.rank of the sum over dp of ``grad`` (N c elements)."""
        c, m, local = target.numel(), self.nodes, self.local
        rows = grad.view(m, local, c).transpose(0, 1).reshape(local, m * c)       # row j: to local rank j
        partial = self._exchange_and_sum(rows, self.intra)                        # [m c]
        full = self._exchange_and_sum(partial.view(m, c), self.inter)              # [c]
        target.copy_(full)

    @staticmethod
    def inbox_bytes(bucket_bytes: int, n: int, on_cuda: bool) -> int:
        """Nothing stays in flight: the reduction is synchronous."""
        return 0

    def _exchange_and_sum(self, rows: torch.Tensor, group) -> torch.Tensor:
        """Row j goes to group rank j (int8 on the wire); returns the sum of the rows received."""
        if group_size(group) == 1:
            return rows.reshape(-1).float() if rows.shape[0] == 1 else rows.sum(0, dtype=torch.float32)
        packed = pack_rows(rows, self.block)
        received = torch.empty_like(packed)
        comm.all_to_all(received, packed, group, self.comm_log, self.tag)
        return unpack_rows(received, rows.shape[1], self.block).sum(0)


def build_reducer(dp: DataParallel, comm_log: CommLog, quantized: bool, block: int):
    """The reducer a ZeRO config asks for: qgZ's when ``quantized``, else the plain reduce-scatter."""
    return HierarchicalReducer(dp, comm_log, block) if quantized else ReduceScatter(dp, comm_log)
