"""ZeRO++ (arXiv 2306.10209): ZeRO's communication made node-aware, in three switches.

* qwZ, ``--zero-quantized-weights``: stage 3's parameter all-gathers send block-wise int8 values with
  one fp32 scale per block (:mod:`.quantize`), dequantized on arrival. Each rank quantizes a copy of
  its shard; the shards the optimizer updates (and its fp32 masters) are never quantized.
* hpZ, ``--zero-hpz-partition-size K``: after a unit's forward all-gather, each rank keeps a secondary
  shard, 1/K of the unit, over its block of K consecutive dp ranks (``Topology.dp_partition_group``);
  the backward all-gather runs over those K ranks only (inside a node when K = dp ranks per node).
  The secondary holds the values the forward used (dequantized, with qwZ), so backward sees the same
  weights; it is refreshed by every forward and stale after the optimizer step. Extra memory per
  rank: 2Ψ/K bytes (bf16), counted in ``params`` by ``model_state_bytes`` and by the estimator.
* qgZ, ``--zero-quantized-gradients`` (stages 2 and 3): a bucket's gradients are reduce-scattered by
  two quantized all-to-alls, first inside the node, then across nodes (:class:`HierarchicalReducer`).

Who holds what, hpZ, dp = 8 on 2 nodes of 4, K = 4, a unit of 8 x 64 elements::

    primary shard   (optimizer's)  dp rank r: elements [64 r, 64 r + 64)
    forward         all-gather over all 8 ranks (int8 with qwZ) -> full unit
    secondary shard                dp rank r: elements [128 (r % 4), 128 (r % 4) + 128)
    backward        all-gather of the secondary over dp ranks {0-3} or {4-7}: no inter-node bytes

Bytes per rank per micro-batch (Ψ elements of e bytes, counted by :mod:`megazero.parallel.counted_comm`,
N = dp, blocks of B elements add 4/B bytes per element): ZeRO-3 sends 3 e Ψ (N-1)/N. ZeRO++ sends
(1 + 4/B) Ψ (N-1)/N for the forward gather (qwZ), e Ψ (K-1)/K for the backward one (hpZ), and for
the gradients (qgZ, L dp ranks per node, M nodes) (1 + 4/B) Ψ (L-1)/L inside the node, then
(1 + 4/B) Ψ/L (M-1)/M across nodes.
"""
from __future__ import annotations

import torch

from megazero.config import ZeroConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.comm import group_size
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.topology import Topology
from megazero.parallel.zero.buckets import Bucket, nbytes
from megazero.parallel.zero.grad_sync import MicrobatchShardedGradSync, ShardedGradSync
from megazero.parallel.zero.param_sync import ShardedParamSync, in_backward
from megazero.parallel.zero.quantize import pack_rows, packed_columns, unpack_rows


class HierarchicalReducer:
    """qgZ: sum a gradient bucket over dp with two quantized all-to-alls, ending in the same shard as a
    reduce-scatter (dp rank r holds chunk r of N).

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

    def __init__(self, topo: Topology, block: int, comm_log: CommLog):
        self.block, self.comm_log = block, comm_log
        self.intra, self.inter = topo.dp_intra_group, topo.dp_inter_group
        self.local, self.nodes = len(topo.dp_intra_ranks), len(topo.dp_inter_ranks)
        if not topo.dp_intra_ranks or self.local * self.nodes != topo.dp_size or \
                topo.dp_intra_ranks != topo.dp_ranks[(topo.dp_rank // self.local) * self.local:][:self.local]:
            raise ValueError(f"--zero-quantized-gradients needs each data-parallel group split evenly over its "
                             f"nodes in blocks of consecutive ranks (dp group {topo.dp_ranks}, "
                             f"{topo.ranks_per_node} ranks per node): change --ranks-per-node or the layout")

    def reduce_scatter(self, target: torch.Tensor, grad: torch.Tensor) -> None:
        """``target`` (c elements) = chunk dp_rank of the sum over dp of ``grad`` (N c elements)."""
        c, m, local = target.numel(), self.nodes, self.local
        rows = grad.view(m, local, c).transpose(0, 1).reshape(local, m * c)       # row j: to local rank j
        partial = self._exchange_and_sum(rows, self.intra)                        # [m c]
        full = self._exchange_and_sum(partial.view(m, c), self.inter)              # [c]
        target.copy_(full)

    def _exchange_and_sum(self, rows: torch.Tensor, group) -> torch.Tensor:
        """Row j goes to group rank j (int8 on the wire); returns the sum of the rows received."""
        if group_size(group) == 1:
            return rows.reshape(-1).float() if rows.shape[0] == 1 else rows.sum(0, dtype=torch.float32)
        packed = pack_rows(rows, self.block)
        received = torch.empty_like(packed)
        comm.all_to_all(received, packed, group, self.comm_log, "dp")
        return unpack_rows(received, rows.shape[1], self.block).sum(0)


class QuantizedGradSync(ShardedGradSync):
    """Stage 2 with qgZ: :class:`ShardedGradSync`, its reduce-scatter replaced (synchronous)."""

    def __init__(self, chunks, topo: Topology, zero_cfg: ZeroConfig, *, comm_log: CommLog | None = None):
        super().__init__(chunks, topo, zero_cfg, comm_log=comm_log)
        self.reducer = HierarchicalReducer(topo, zero_cfg.quantization_block_size, self.comm_log)

    def reduce_scatter_grads(self, target: torch.Tensor, grad_data: torch.Tensor):
        self.reducer.reduce_scatter(target, grad_data)
        return None


class MicrobatchQuantizedGradSync(QuantizedGradSync, MicrobatchShardedGradSync):
    """Stage 2 reducing every micro-batch (``--zero2-reduce-each-microbatch``) with qgZ."""


class ZeroPlusPlusParamSync(ShardedParamSync):
    """Stage 3 with any of qwZ, hpZ, qgZ on (see the module docstring); off switches behave as stage 3."""

    def __init__(self, chunks, topo: Topology, zero_cfg: ZeroConfig, **kwargs):
        self.quantize_weights = bool(zero_cfg.quantized_weights)
        self.block = zero_cfg.quantization_block_size
        k = zero_cfg.hpz_partition_size
        self.hpz_size = k if k > 1 else 0
        self.hpz_group = topo.dp_partition_group(k)[0] if self.hpz_size else None
        self.secondaries: list[torch.Tensor] = []
        super().__init__(chunks, topo, zero_cfg, **kwargs)
        self.reducer = (HierarchicalReducer(topo, self.block, self.comm_log)
                        if zero_cfg.quantized_gradients else None)
        if self.hpz_size:
            for b in self.buckets:               # allocated once: part of the steady model state
                b.secondary = torch.zeros(b.numel // self.hpz_size, dtype=b.param_data.dtype,
                                          device=b.param_data.device)
                b.secondary_valid = False
                self.param_buffers.append(b.secondary)
                self.secondaries.append(b.secondary)

    def secondary_bytes(self) -> int:
        return sum(nbytes(t) for t in self.secondaries)

    def launch_gather(self, bucket: Bucket, source: torch.Tensor, exact: bool):
        """Backward with a valid secondary: gather it over the hpZ block. Otherwise all dp ranks, int8
        with qwZ (``exact``: the plain values, for ``gathered_parameters``)."""
        if self.hpz_size and not exact and in_backward() and bucket.secondary_valid:
            return ("secondary", comm.all_gather(bucket.param_data, bucket.secondary, self.hpz_group,
                                                 self.comm_log, "dp", async_op=True))
        if not self.quantize_weights or exact:
            return ("plain", super().launch_gather(bucket, source, exact))
        packed = pack_rows(source.reshape(1, -1), self.block).reshape(-1)
        staging = torch.empty(self.dp_size * packed.numel(), dtype=torch.uint8, device=packed.device)
        return ("int8", comm.all_gather(staging, packed, self.dp_group, self.comm_log, "dp", async_op=True), staging)

    def finish_gather(self, bucket: Bucket, pending) -> None:
        kind, handle = pending[0], pending[1]
        if handle is not None:
            handle.wait()
        if kind == "int8":
            rows = pending[2].view(self.dp_size, packed_columns(bucket.shard_size, self.block))
            bucket.param_data.copy_(unpack_rows(rows, bucket.shard_size, self.block, bucket.param_data.dtype).view(-1))
        if self.hpz_size and kind != "secondary" and not in_backward():
            size = bucket.secondary.numel()
            lo = (self.dp_rank % self.hpz_size) * size
            bucket.secondary.copy_(bucket.param_data[lo:lo + size])
            bucket.secondary_valid = True

    def flush_params(self) -> None:
        """The optimizer published new shards: secondaries are stale until the next forward gather."""
        super().flush_params()
        self._invalidate()

    def write_back(self) -> None:
        super().write_back()
        self._invalidate()

    def _invalidate(self) -> None:
        for b in self.buckets:
            b.secondary_valid = False

    def reduce_scatter_grads(self, target: torch.Tensor, grad_data: torch.Tensor):
        if self.reducer is None:
            return super().reduce_scatter_grads(target, grad_data)
        self.reducer.reduce_scatter(target, grad_data)
        return None
