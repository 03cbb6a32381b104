"""Stage 3's gathering component: how a unit's buckets are filled from every rank's shard. The plain
all-gather (:class:`AllGather`), or ZeRO++'s node-aware one.

ZeRO++ (arXiv 2306.10209): ZeRO's communication made node-aware, in three switches, each a component.

* qwZ, ``--zero-quantized-weights``: stage 3's parameter all-gathers send block-wise int8 values with
  one fp32 scale per block (:mod:`.quantize`), dequantized on arrival. Each rank quantizes a copy of
  its shard; the shards the optimizer updates (and its fp32 masters) are never quantized.
* hpZ, ``--zero-hpz-partition-size K``: after a unit's forward all-gather, each rank keeps a secondary
  shard, 1/K of the unit, over its block of K consecutive dp ranks (``DataParallel.partition(K)``);
  the backward all-gather runs over those K ranks only (inside a node when K = dp ranks per node).
  The secondary holds the values the forward used (dequantized, with qwZ), so backward sees the same
  weights; it is refreshed by every forward and stale after the optimizer step. Extra memory per
  rank: 2Ψ/K bytes (bf16), counted in ``params`` by ``model_state_bytes`` and by the estimator.
* qgZ, ``--zero-quantized-gradients`` (stages 2 and 3): a bucket's gradients are reduce-scattered by
  two quantized all-to-alls, first inside the node, then across nodes
  (:class:`megazero.parallel.zero.reducers.HierarchicalReducer`, the grad sync's reducer component).

qwZ and hpZ are one gathering component, :class:`ZeroPlusPlusGathering`, which stage 3's parameter
component (:class:`megazero.parallel.zero.param_sync.ShardedParams`) takes in place of the plain
all-gather; :func:`build_gathering` picks one from the config. A gathering is attached to one bucket
group's parameters (``attach``): it gathers over that group's data-parallel view, so the experts'
hpZ blocks are cut from the expert-data-parallel group.

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

from megazero.parallel import counted_comm as comm
from megazero.parallel.zero.buckets import Bucket, nbytes
from megazero.parallel.zero.fp8_gather import FP8Wire
from megazero.parallel.zero.quantize import pack_rows, packed_columns, unpack_rows
from megazero.parallel.zero.units import in_backward


class AllGather:
    """How a unit's bucket is filled from every rank's shard: a plain all-gather over the bucket group's
    dp (the default gathering), with the FP8 weights in FP8 under ``--fp8-param-gather``
    (:mod:`.fp8_gather`). ``launch`` starts it, ``finish`` completes it."""

    def attach(self, params) -> None:
        """``params``: the :class:`~megazero.parallel.zero.param_sync.ShardedParams` whose buckets this fills
        (its ``dp`` view, ``comm_log``, ``buckets`` and ``buffers``)."""
        self.params = params
        self.fp8 = FP8Wire(params.dp, params.comm_log)

    def launch(self, bucket: Bucket, source: torch.Tensor, exact: bool):
        """Start filling ``bucket`` from every rank's ``source`` (its shard); ``exact``: the shards' own
        values, never rounded through FP8 (for ``gathered_parameters``)."""
        dp = self.params.dp
        if not exact and self.fp8.plan(bucket) is not None:
            return self.fp8.launch(bucket, source, self.fp8.agree([(bucket, source)])[0])
        return comm.all_gather(bucket.param_data, source, dp.group, self.params.comm_log, dp.tag, async_op=True)

    def finish(self, bucket: Bucket, pending) -> None:
        if pending is not None:
            pending.wait()

    def invalidate(self) -> None:
        """New shard values were written (nothing cached here)."""

    def held_bytes(self) -> int:
        """Device bytes this gathering keeps beside the shards (hpZ's secondaries; none here)."""
        return 0


class ZeroPlusPlusGathering(AllGather):
    """Stage 3's gathering with qwZ and/or hpZ (see the module docstring); off switches behave as the
    plain all-gather."""

    def __init__(self, quantize_weights: bool, block: int, hpz_partition_size: int):
        self.quantize_weights, self.block = quantize_weights, block
        self.hpz_size = hpz_partition_size if hpz_partition_size > 1 else 0
        self.secondaries: list[torch.Tensor] = []

    def attach(self, params) -> None:
        """Once the buckets exist: the hpZ group and one secondary shard per bucket, allocated once
        (part of the steady model state, among the parameters' buffers)."""
        super().attach(params)
        self.hpz_group = params.dp.partition(self.hpz_size).group if self.hpz_size else None
        if self.hpz_size:
            for b in params.buckets:
                b.secondary = torch.zeros(b.numel // self.hpz_size, dtype=b.param_data.dtype,
                                          device=b.param_data.device)
                b.secondary_valid = False
                params.buffers.append(b.secondary)
                self.secondaries.append(b.secondary)

    def held_bytes(self) -> int:
        """The secondary shards' bytes (within the params' bytes)."""
        return sum(nbytes(t) for t in self.secondaries)

    def launch(self, bucket: Bucket, source: torch.Tensor, exact: bool):
        """Backward with a valid secondary: gather it over the hpZ block. Otherwise all dp ranks, int8
        with qwZ (``exact``: the plain values, for ``gathered_parameters``)."""
        dp, comm_log = self.params.dp, self.params.comm_log
        if self.hpz_size and not exact and in_backward() and bucket.secondary_valid:
            return ("secondary", comm.all_gather(bucket.param_data, bucket.secondary, self.hpz_group,
                                                 comm_log, dp.tag, async_op=True))
        if not self.quantize_weights or exact:
            return ("plain", super().launch(bucket, source, exact))
        packed = pack_rows(source.reshape(1, -1), self.block).reshape(-1)
        staging = torch.empty(dp.size * packed.numel(), dtype=torch.uint8, device=packed.device)
        return ("int8", comm.all_gather(staging, packed, dp.group, comm_log, dp.tag, async_op=True), staging)

    def finish(self, bucket: Bucket, pending) -> None:
        dp = self.params.dp
        kind, handle = pending[0], pending[1]
        if handle is not None:
            handle.wait()
        if kind == "int8":
            rows = pending[2].view(dp.size, packed_columns(bucket.shard_size, self.block))
            bucket.param_data.copy_(unpack_rows(rows, bucket.shard_size, self.block, bucket.param_data.dtype).view(-1))
        if self.hpz_size and kind != "secondary" and not in_backward():
            size = bucket.secondary.numel()
            lo = (dp.rank % self.hpz_size) * size
            bucket.secondary.copy_(bucket.param_data[lo:lo + size])
            bucket.secondary_valid = True

    def invalidate(self) -> None:
        """New shards were published (optimizer step, ``write_back``): secondaries are stale until the
        next forward gather."""
        for b in self.params.buckets if self.hpz_size else ():
            b.secondary_valid = False


def build_gathering(quantized_weights: bool, block: int, hpz_partition_size: int) -> AllGather:
    """Stage 3's gathering for a ZeRO config: ZeRO++'s when qwZ or hpZ is on, else the plain all-gather."""
    if quantized_weights or hpz_partition_size > 1:
        return ZeroPlusPlusGathering(quantized_weights, block, hpz_partition_size)
    return AllGather()
