"""``--fp8-param-gather``: ZeRO's parameter all-gathers send the FP8 linears' weights as 1-byte FP8 values.

Which all-gathers: stage 3's per-unit gathers (:class:`megazero.parallel.zero.zeropp.AllGather`, also under
hpZ's forward gather) and stages 1-2's all-gather of the updated shards after the optimizer step
(:class:`megazero.parallel.zero.publish.AllGatherShards`). Which parameters: the weights whose
:class:`~megazero.parallel.fp8.LinearFP8` (``param.fp8_linear``, stamped by
:func:`megazero.parallel.fp8.enable`) has ``recipe.param_gather``; every other element of a bucket (norms,
biases, embeddings, the router, layers left in the parameters' precision, padding) travels in the
parameters' dtype as before. The fp32 masters, the optimizer state, stage 3's shards and checkpoints keep
their exact values: only the gathered copies are rounded.

**Why the run stays the serial FP8 run.** A weight is cast with the scale its linear will use: the
delayed history's, or (tensorwise, and the delayed recipe's first step) the scale of the amax of the
whole weight. Each dp rank holds a flat piece of the tp-local weight and each tp rank a tp shard, so the
gatherer agrees the amaxes of a bucket's FP8 weights with one MAX all-reduce of one small vector over
dp, then one over the groups splitting the weights (tp), and every rank computes the same scales
(:meth:`LinearFP8.weight_scale`): the scales need not travel. On arrival the FP8 values are
dequantized into the parameter's storage (q / scale, in the parameters' dtype). The linear casts the
dequantized weight again with the same scale, and q / scale * scale rounds back to q (fp32 and bf16 keep
at least 8 mantissa bits, e4m3 3): the products see the FP8 values the serial run computes from the exact
weight. The amax of the dequantized weight may differ from the exact one (a value above the history's
amax saturates to 448 / scale), so the gatherer leaves the agreed exact amax on the linear
(``weight_amax``), which its scale and the delayed history take instead. A rank's own piece keeps its
exact values (at stages 1-2 it is the fp32 master itself with fp32 parameters).

**Wire format.** Rank r's payload is its shard's elements in the parameters' dtype, then those of FP8
weights as e4m3 bytes (one byte each), padded to the largest payload of the bucket's ranks rounded up
to 16 bytes (an all-gather sends equal pieces). Worked example, dp = 2, fp32 (4 bytes), a bucket of 128
elements: a bias b (32) then an FP8 weight w (96); rank 0's shard [0, 64) holds b and w[0:32] (32 * 4 +
32 = 160 bytes), rank 1's [64, 128) w[32:96] (64 bytes): each piece 160 bytes, 320 gathered, against
512 in fp32.

Bytes per rank (ring accounting of :mod:`megazero.parallel.counted_comm`, N = dp, e the parameters' bytes
per element, Ψ8 the FP8 weights' elements, Ψo the others' and the padding, k the FP8 weights of a
bucket)::

    all-gather       (Ψ8 + e Ψo) (N-1)/N      against e (Ψ8 + Ψo) (N-1)/N: half of bf16's for the weights
                     (plus at most 16 bytes and the imbalance of the ranks' payloads per bucket)
    amax agreement   2 (N-1)/N * 4k over dp, and 2 (tp-1)/tp * 4k over tp, per gathered bucket

Memory: the gathered buffer stays in the parameters' dtype; the staging buffer of a gather in flight
holds N payloads (about 1 byte per FP8 weight element) until it is dequantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.parallel import counted_comm as comm
from megazero.parallel.zero.buckets import Bucket

WIRE_ALIGN = 16          # bytes: each rank's payload starts aligned for any parameter dtype


@dataclass(frozen=True)
class Segment:
    """Bucket elements [lo, hi) of one rank's shard and where they sit in its payload (``offset``, bytes):
    part of FP8 weight ``weight`` (its index in the bucket's :attr:`WirePlan.states`), or -1: sent in
    the parameters' dtype."""

    lo: int
    hi: int
    weight: int
    offset: int


@dataclass
class WirePlan:
    """How one bucket travels: the FP8 weights' slots (``spans``: bucket elements [start, end)) and
    scaling states, each rank's segments, and the payload size every rank sends (``piece``, bytes)."""

    spans: list[tuple[int, int]]
    states: list
    segments: list[list[Segment]]
    piece: int


def gathers_in_fp8(param) -> bool:
    """Is ``param`` a weight that ZeRO's parameter all-gathers send in FP8 (``--fp8-param-gather``)?"""
    state = getattr(param, "fp8_linear", None)
    return state is not None and state.recipe.param_gather


def plan_wire(bucket: Bucket, dp_size: int) -> WirePlan | None:
    """The wire layout of ``bucket`` over ``dp_size`` ranks (module docstring), or None when it holds no
    weight gathered in FP8 or nothing travels (one rank). Pure: from the bucket's slots and shard size."""
    fp8 = sorted(((s.start, s.end, s.param.fp8_linear) for s in bucket.slots if gathers_in_fp8(s.param)),
                 key=lambda x: x[0])
    if not fp8 or dp_size == 1:
        return None
    elem = bucket.param_data.element_size()
    segments, sizes = [], []
    for r in range(dp_size):
        lo, hi = bucket.shard_range(r)
        plain, weights = [], []
        at = lo
        for k, (start, end, _) in enumerate(fp8):
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            if at < a:
                plain.append((at, a))
            weights.append((a, b, k))
            at = b
        if at < hi:
            plain.append((at, hi))
        mine, offset = [], 0
        for a, b in plain:
            mine.append(Segment(a, b, -1, offset))
            offset += (b - a) * elem
        for a, b, k in weights:
            mine.append(Segment(a, b, k, offset))
            offset += b - a
        segments.append(mine)
        sizes.append(offset)
    piece = -(-max(sizes) // WIRE_ALIGN) * WIRE_ALIGN
    return WirePlan([(start, end) for start, end, _ in fp8], [s for _, _, s in fp8], segments, piece)


class FP8Wire:
    """Gathers the buckets of one bucket group (over its ``dp`` view) with their FP8 weights in FP8:
    :meth:`agree` finds the scales (collectives over dp and tp, every rank of the group at the same
    point), :meth:`launch` starts the all-gather and returns an :class:`Arrival` whose ``wait()``
    dequantizes into ``bucket.param_data``."""

    def __init__(self, dp, comm_log):
        self.dp, self.comm_log = dp, comm_log
        self._plans: dict[int, WirePlan | None] = {}

    def plan(self, bucket: Bucket) -> WirePlan | None:
        key = id(bucket)
        if key not in self._plans:
            self._plans[key] = plan_wire(bucket, self.dp.size)
        return self._plans[key]

    @torch.no_grad()
    def agree(self, sources: list[tuple[Bucket, torch.Tensor]]) -> list[torch.Tensor]:
        """The scales of the FP8 weights of each bucket in ``sources`` (bucket, this rank's shard of it),
        one fp32 vector per bucket: the amaxes of the pieces, one MAX all-reduce over dp, one over each
        distinct set of groups splitting the weights (tp); each linear keeps its weight's agreed amax."""
        plans = [self.plan(b) for b, _ in sources]
        local = []
        for (bucket, shard), plan in zip(sources, plans):
            lo, hi = bucket.shard_range(self.dp.rank)
            for start, end in plan.spans:
                a, b = max(lo, start), min(hi, end)
                local.append(shard[a - lo:b - lo].abs().max().float() if a < b else shard.new_zeros((), dtype=torch.float32))
        amax = torch.stack(local)
        comm.all_reduce(amax, self.dp.group, self.comm_log, self.dp.tag, op=dist.ReduceOp.MAX)
        states = [s for plan in plans for s in plan.states]
        by_groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            by_groups.setdefault(s.weight_groups(), []).append(i)
        for groups, rows in by_groups.items():
            for g in groups:
                part = amax[rows]
                comm.all_reduce(part, g, self.comm_log, "tp", op=dist.ReduceOp.MAX)
                amax[rows] = part
        scales, i = [], 0
        for plan in plans:
            mine = []
            for s in plan.states:
                s.weight_amax = amax[i]
                mine.append(s.weight_scale(amax[i]).reshape(()).float())
                i += 1
            scales.append(torch.stack(mine))
        return scales

    @torch.no_grad()
    def launch(self, bucket: Bucket, shard: torch.Tensor, scales: torch.Tensor) -> Arrival:
        """Cast this rank's ``shard`` of ``bucket`` onto the wire and start the all-gather (asynchronous)."""
        plan, n, me = self.plan(bucket), self.dp.size, self.dp.rank
        staging = torch.empty(n * plan.piece, dtype=torch.uint8, device=shard.device)
        payload = staging[me * plan.piece:(me + 1) * plan.piece]
        lo = bucket.shard_range(me)[0]
        for seg in plan.segments[me]:
            values = shard[seg.lo - lo:seg.hi - lo]
            if seg.weight < 0:
                raw = values.view(torch.uint8)
            else:
                state = plan.states[seg.weight]
                raw = state.cast(values, scales[seg.weight], state.recipe.forward_dtype).view(torch.uint8)
            payload[seg.offset:seg.offset + raw.numel()].copy_(raw)
        handle = comm.all_gather(staging, payload, self.dp.group, self.comm_log, self.dp.tag, async_op=True)
        return Arrival(handle, staging, bucket, plan, scales, shard, me)


class Arrival:
    """An FP8 all-gather in flight: ``wait()`` completes it and writes every other rank's piece into
    ``bucket.param_data`` (FP8 values dequantized in the parameters' dtype), and this rank's exact
    shard where it is not already there. Waiting twice does nothing."""

    def __init__(self, handle, staging, bucket, plan, scales, shard, rank):
        self.handle, self.staging, self.bucket, self.plan = handle, staging, bucket, plan
        self.scales, self.shard, self.rank = scales, shard, rank

    @torch.no_grad()
    def wait(self) -> None:
        if self.staging is None:
            return
        if self.handle is not None:
            self.handle.wait()
        data, plan = self.bucket.param_data, self.plan
        for r, segments in enumerate(plan.segments):
            if r == self.rank:
                continue
            piece = self.staging[r * plan.piece:(r + 1) * plan.piece]
            for seg in segments:
                n = seg.hi - seg.lo
                if seg.weight < 0:
                    data[seg.lo:seg.hi].copy_(piece[seg.offset:seg.offset + n * data.element_size()].view(data.dtype))
                else:
                    fp8 = piece[seg.offset:seg.offset + n].view(plan.states[seg.weight].recipe.forward_dtype)
                    data[seg.lo:seg.hi].copy_(fp8.float().div_(self.scales[seg.weight]))
        lo, hi = self.bucket.shard_range(self.rank)
        if self.shard.data_ptr() != data[lo:hi].data_ptr():
            data[lo:hi].copy_(self.shard)
        self.staging = self.shard = None


def forget_weight_amaxes(syncs) -> None:
    """The parameters were written with exact values outside a gather (a checkpoint load, a write-back):
    the linears take their weights' amaxes from the weights again."""
    for sync in syncs:
        for bucket in sync.buckets:
            for slot in bucket.slots:
                if gathers_in_fp8(slot.param):
                    slot.param.fp8_linear.weight_amax = None
