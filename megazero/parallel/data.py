"""Data parallelism: parameters and gradients in contiguous buckets, reduced over the DP group.

Layout. Each model chunk's parameters are copied into one contiguous buffer (``param.data`` becomes
a view into it) in *reverse* registration order, which is roughly the order backward produces their
gradients. The buffer is cut into buckets of about ``ZeroConfig.bucket_size`` elements (a parameter
never straddles two buckets; the tied word embedding always gets a bucket of its own) and every
bucket is padded so that it splits into ``dp`` equal, 64-element-aligned shards. Gradients use the
same layout: ``param.grad`` is a view into the gradient storage of its bucket, so autograd
accumulates micro-batches in place.

Worked example, dp = 2, bucket_size = 5, three parameters w (6), b (3), ln (2) registered in that
order, pad multiple 1 for readability::

    bucket 0: ln[0:2] b[0:3] + pad 1      -> 6 elements, rank 0 owns [0, 3), rank 1 owns [3, 6)
    bucket 1: w[0:6]                       -> 6 elements, rank 0 owns w[0:3], rank 1 owns w[3:6]

Reduction. The pipeline schedule calls ``before_backward(chunk_id, is_last_microbatch)`` before
every backward. On the last micro-batch, a hook on each parameter counts down its bucket; when the
bucket's last gradient has arrived the bucket is scaled by 1/dp and its reduction is launched
asynchronously, overlapping the rest of backward. ``finish_grad_sync()`` waits for all of them.
Three reductions, one small class each:

    AllReduceGradSync      stage 0 (plain DP): all-reduce; every rank holds the full averaged grads.
    ReduceScatterGradSync  stage 1: reduce-scatter in place; rank r's shard of every bucket holds the
                           averaged grads, the rest of its full-size buffer is stale.
    ShardedGradSync        stage 2: reduce-scatter into a 1/dp shard; a bucket's full-size storage
                           exists only from its first gradient of the step until its reduction
                           completes.
    MicrobatchShardedGradSync  stage 2 with ``--zero2-reduce-each-microbatch``: the same, reduced
                           after every micro-batch's backward (DeepSpeed's stage 2).

Memory, honestly: stage 2 holds 1/dp of the gradients during the optimizer step and none during
the next forward. A bucket's full storage is allocated when its first gradient arrives, so at the
start of backward (the activation peak) no gradient memory is held. With several micro-batches
every bucket holds its full storage from the first micro-batch's backward until its reduction on
the last one (the reduction happens once, so the sum must live somewhere until then): the
gradient peak is then the full size plus the shards of the buckets in flight (a little more than
stages 0/1), and what stage 2 saves is 2Ψ(N-1)/N bytes outside backward. DeepSpeed instead reduces every micro-batch into the shard, trading N_micro
times the gradient traffic for a lower peak; by default we keep the traffic of plain DP, and
``--zero2-reduce-each-microbatch`` (:class:`MicrobatchShardedGradSync`) does it DeepSpeed's way.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from megazero.config import ZeroConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.topology import Topology

PAD_MULTIPLE = 64  # elements per shard are a multiple of this (128-byte aligned in half precision)


@dataclass
class ParamSlot:
    """Where one parameter lives: elements [start, end) of bucket ``bucket``."""

    name: str
    param: nn.Parameter
    bucket: "Bucket"
    start: int
    end: int


@dataclass
class Bucket:
    """A contiguous, padded range of one chunk's buffer, reduced as one collective.

    ``param_data`` is a view into the chunk's parameter buffer. ``grad_data`` is the full-size
    gradient storage (a view into the chunk's gradient buffer, or a bucket-own tensor for stage 2;
    None while not allocated). ``shard_size`` = numel / dp: rank r owns [r*shard_size, (r+1)*shard_size).
    """

    chunk_id: int
    index: int
    offset: int
    numel: int
    shard_size: int
    slots: list[ParamSlot] = field(default_factory=list)
    param_data: torch.Tensor | None = None
    grad_data: torch.Tensor | None = None
    pending: int = 0
    handle: object = None
    launched: bool = False


def plan_buckets(numels: list[int], own_bucket: list[bool], bucket_size: int, dp: int,
                 pad_multiple: int = PAD_MULTIPLE) -> list[tuple[list[tuple[int, int, int]], int]]:
    """Pure bucket layout: for parameters of the given sizes (in bucket-filling order), return
    ``[([(param_index, start, end), ...], padded_numel), ...]``.

    A bucket is closed once it holds >= bucket_size elements; a parameter with ``own_bucket`` gets a
    bucket alone. Each bucket's size is rounded up to a multiple of ``dp * pad_multiple``.
    """
    buckets, current, filled = [], [], 0

    def close() -> None:
        nonlocal current, filled
        if current:
            quantum = dp * pad_multiple
            buckets.append((current, -(-filled // quantum) * quantum))
        current, filled = [], 0

    for i, (n, alone) in enumerate(zip(numels, own_bucket)):
        if alone:
            close()
        current.append((i, filled, filled + n))
        filled += n
        if alone or filled >= bucket_size:
            close()
    close()
    return buckets


class _BucketedGradSync:
    """Shared machinery: buffers, buckets, hooks, micro-batch bookkeeping, finalize.

    Subclasses say how a bucket is reduced (``_launch``), what happens when it is done
    (``_after_reduce``) and where the reduced gradient of a bucket range lives (``reduced_grad``).
    """

    def __init__(self, chunks: nn.Module | list[nn.Module], topo: Topology, zero_cfg: ZeroConfig | None = None,
                 *, comm_log: CommLog | None = None):
        self.chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.topo = topo
        self.cfg = zero_cfg or ZeroConfig()
        self.comm_log = comm_log if comm_log is not None else CommLog()
        self.dp_group, self.dp_size, self.dp_rank = topo.dp_group, topo.dp_size, topo.dp_rank
        self.buckets: list[Bucket] = []
        self.slots: list[ParamSlot] = []
        self._slot_of: dict[int, ParamSlot] = {}
        self.param_buffers: list[torch.Tensor] = []
        self.grad_buffers: list[torch.Tensor | None] = []
        self._sync_now = [True] * len(self.chunks)
        self._synced = False
        for chunk_id, chunk in enumerate(self.chunks):
            self._build_chunk(chunk_id, chunk)
        self._reset_countdown()

    # ----------------------------------------------------------------- layout
    def _build_chunk(self, chunk_id: int, chunk: nn.Module) -> None:
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad][::-1]
        if not named:
            self.param_buffers.append(torch.empty(0))
            self.grad_buffers.append(None)
            return
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"model chunk {chunk_id} mixes parameter dtypes {sorted(map(str, dtypes))}: "
                             f"build the model in one dtype (--bf16 / --fp16 or fp32)")
        dtype, device = named[0][1].dtype, named[0][1].device
        plan = plan_buckets([p.numel() for _, p in named],
                            [bool(getattr(p, "shared_embedding", False)) for _, p in named],
                            self.cfg.bucket_size, self.dp_size)
        total = sum(padded for _, padded in plan)
        pbuf = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for members, padded in plan:
            bucket = Bucket(chunk_id, len(self.buckets), offset, padded, padded // self.dp_size)
            bucket.param_data = pbuf[offset:offset + padded]
            for i, start, end in members:
                name, p = named[i]
                view = bucket.param_data[start:end].view_as(p)
                view.copy_(p.data)
                p.data = view
                slot = ParamSlot(name, p, bucket, start, end)
                bucket.slots.append(slot)
                self.slots.append(slot)
                self._slot_of[id(p)] = slot
                p.register_post_accumulate_grad_hook(_weak_hook(self))
            self.buckets.append(bucket)
            offset += padded
        self.param_buffers.append(pbuf)
        self.grad_buffers.append(self._make_grad_buffer(total, dtype, device))
        for bucket in self.buckets:
            if bucket.chunk_id == chunk_id:
                self._attach_grads(bucket)

    def _make_grad_buffer(self, total: int, dtype, device) -> torch.Tensor | None:
        return torch.zeros(total, dtype=dtype, device=device)

    def _attach_grads(self, bucket: Bucket) -> None:
        """Point ``bucket.grad_data`` and every ``param.grad`` of the bucket at persistent storage."""
        buf = self.grad_buffers[bucket.chunk_id]
        bucket.grad_data = buf[bucket.offset:bucket.offset + bucket.numel]
        for s in bucket.slots:
            s.param.grad = bucket.grad_data[s.start:s.end].view_as(s.param)

    def _ensure_grad_storage(self, bucket: Bucket) -> torch.Tensor:
        return bucket.grad_data

    # ------------------------------------------------------------- backward
    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """Called by the schedule before each backward of ``chunk_id``: reduce only on the last one."""
        self._sync_now[chunk_id] = is_last_microbatch
        self._synced = False

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        slot = self._slot_of[id(param)]
        bucket = slot.bucket
        grad_data = self._ensure_grad_storage(bucket)
        view = grad_data[slot.start:slot.end]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.add_(param.grad.reshape(-1))     # autograd made a fresh .grad: fold it into the bucket
            param.grad = view.view_as(param)
        if self._sync_now[bucket.chunk_id] and self.cfg.overlap_grad_reduce:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        grad_data = self._ensure_grad_storage(bucket)
        if self.dp_size > 1:
            grad_data.mul_(1.0 / self.dp_size)
        bucket.handle = self._launch(bucket, grad_data)
        bucket.launched = True

    def finish_grad_sync(self) -> None:
        """Launch what backward did not (unused parameters, overlap off), wait for everything."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._start(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle = None
            self._after_reduce(bucket)
        self._reset_countdown()
        self._synced = True

    def _reset_countdown(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.launched = len(bucket.slots), False

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        raise NotImplementedError

    def _after_reduce(self, bucket: Bucket) -> None:
        pass

    # ------------------------------------------------------- after the sync
    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """The bucket elements this DP rank owns in ZeRO: [dp_rank * shard, (dp_rank + 1) * shard)."""
        return self.dp_rank * bucket.shard_size, (self.dp_rank + 1) * bucket.shard_size

    def reduced_grad(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """View of the DP-averaged gradient for bucket elements [lo, hi) (must be held by this rank)."""
        return bucket.grad_data[lo:hi]

    def grad_range(self, bucket: Bucket) -> tuple[int, int]:
        """The bucket range whose reduced gradient this rank holds after the sync."""
        return 0, bucket.numel

    def local_grad_segments(self, slot: ParamSlot) -> list[torch.Tensor]:
        """Views of the reduced gradient of ``slot.param`` this rank holds (flattened pieces)."""
        lo, hi = self.grad_range(slot.bucket)
        a, b = max(lo, slot.start), min(hi, slot.end)
        return [self.reduced_grad(slot.bucket, a, b)] if a < b else []

    def finalize_grads(self) -> None:
        """Finish the DP reduction, then sum the partial grads of parameters marked
        ``sequence_parallel_grad`` (set by the layers only under sequence parallelism) over tp, and the
        tied embedding's grads over the embedding group (first + last pipeline stage).

        Both extra sums act on the reduced gradients this rank holds; tp peers and the two embedding
        stages have identical bucket layouts for those parameters (the tied embedding sits in a
        bucket of its own), so the shards line up and the sums commute with the DP average.
        """
        self.finish_grad_sync()
        if self.topo.tp_size > 1:
            self._sum_segments([s for s in self.slots if getattr(s.param, "sequence_parallel_grad", False)],
                               self.topo.tp_group, "tp")
        if self.topo.pp_size > 1:
            shared = [s for s in self.slots if getattr(s.param, "shared_embedding", False)]
            if shared:
                self._sum_segments(shared, self.topo.embedding_group, "emb")

    def _sum_segments(self, slots: list[ParamSlot], group, tag: str) -> None:
        segments = [seg for s in slots for seg in self.local_grad_segments(s)]
        if not segments:
            return
        flat = torch.cat(segments)
        comm.all_reduce(flat, group, self.comm_log, tag)
        offset = 0
        for seg in segments:
            seg.copy_(flat[offset:offset + seg.numel()])
            offset += seg.numel()

    def check_synced(self) -> None:
        if not self._synced:
            raise RuntimeError("gradients are not synchronised: call finalize_grads() (or "
                               "finish_grad_sync()) after the last backward and before optimizer.step()")

    def zero_grad(self) -> None:
        """Zero the gradient buffers (stages 0/1) for the next step."""
        for buf in self.grad_buffers:
            if buf is not None:
                buf.zero_()
        self._synced = False

    def parameters(self):
        return [s.param for s in self.slots]

    def held_grad_tensors(self) -> list[torch.Tensor]:
        """Gradient storage held right now (for memory accounting)."""
        return [b for b in self.grad_buffers if b is not None]

    @property
    def peak_grad_bytes(self) -> int:
        """Most gradient bytes held at once (stages 0/1: the persistent buffers)."""
        return sum(_nbytes(t) for t in self.held_grad_tensors())


class AllReduceGradSync(_BucketedGradSync):
    """Stage 0, plain data parallelism: every bucket is all-reduced (averaged) over dp."""

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        return comm.all_reduce(grad_data, self.dp_group, self.comm_log, "dp", async_op=True)


class ReduceScatterGradSync(_BucketedGradSync):
    """Stage 1: reduce-scatter each bucket in place; only this rank's shard is read afterwards."""

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        lo, hi = self.shard_range(bucket)
        return comm.reduce_scatter(grad_data[lo:hi], grad_data, self.dp_group, self.comm_log, "dp",
                                   async_op=True)

    def grad_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.shard_range(bucket)


class ShardedGradSync(ReduceScatterGradSync):
    """Stage 2: each rank keeps only its 1/dp shard of the reduced gradients.

    Lifetimes, per bucket: the full-size storage is allocated by the bucket's first gradient of the
    step and released as soon as its reduce-scatter is seen complete (polled whenever another
    bucket is launched, at the latest in ``finish_grad_sync``); the shard is allocated when the
    reduce-scatter is launched and released by ``zero_grad`` at the start of the next step. So the
    optimizer step holds only shards, the next forward holds no gradients at all, and backward
    holds the full storage of buckets not yet reduced. ``peak_grad_bytes`` records the most held
    at once.
    """

    def __init__(self, *args, **kwargs):
        self.grad_shards: dict[int, torch.Tensor] = {}
        self._held = 0
        self._peak = 0
        super().__init__(*args, **kwargs)

    def _make_grad_buffer(self, total: int, dtype, device) -> None:
        return None

    def _attach_grads(self, bucket: Bucket) -> None:
        pass                                     # nothing persistent: see the class docstring

    def _track(self, nbytes: int) -> None:
        self._held += nbytes
        self._peak = max(self._peak, self._held)

    def _ensure_grad_storage(self, bucket: Bucket) -> torch.Tensor:
        if bucket.grad_data is None:
            bucket.grad_data = torch.zeros_like(bucket.param_data)
            self._track(_nbytes(bucket.grad_data))
            for s in bucket.slots:
                if s.param.grad is not None:          # a gradient autograd made before we saw it
                    bucket.grad_data[s.start:s.end].add_(s.param.grad.reshape(-1))
                s.param.grad = bucket.grad_data[s.start:s.end].view_as(s.param)
        return bucket.grad_data

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        shard = self.grad_shards.get(id(bucket))
        if shard is None:
            shard = self.grad_shards[id(bucket)] = torch.empty(bucket.shard_size, dtype=grad_data.dtype,
                                                               device=grad_data.device)
            self._track(_nbytes(shard))
        return comm.reduce_scatter(shard, grad_data, self.dp_group, self.comm_log, "dp", async_op=True)

    def _start(self, bucket: Bucket) -> None:
        super()._start(bucket)
        for b in self.buckets:                   # release every bucket whose reduction is done
            if b.launched and b.grad_data is not None and (b.handle is None or b.handle.is_completed()):
                if b.handle is not None:
                    b.handle.wait()
                b.handle = None
                self._after_reduce(b)

    def _after_reduce(self, bucket: Bucket) -> None:
        for s in bucket.slots:
            s.param.grad = None
        if bucket.grad_data is not None:
            self._held -= _nbytes(bucket.grad_data)
        bucket.grad_data = None

    def reduced_grad(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        base = self.dp_rank * bucket.shard_size
        if lo < base or hi > base + bucket.shard_size:
            raise IndexError(f"stage 2 rank {self.dp_rank} holds bucket elements [{base}, "
                             f"{base + bucket.shard_size}), asked for [{lo}, {hi})")
        return self.grad_shards[id(bucket)][lo - base:hi - base]

    def zero_grad(self) -> None:
        for bucket in self.buckets:         # full storage is normally released by finish_grad_sync
            self._after_reduce(bucket)
        self._held -= sum(_nbytes(t) for t in self.grad_shards.values())
        self.grad_shards.clear()
        self._synced = False

    def held_grad_tensors(self) -> list[torch.Tensor]:
        full = [b.grad_data for b in self.buckets if b.grad_data is not None]
        return list(self.grad_shards.values()) + full

    @property
    def peak_grad_bytes(self) -> int:
        return self._peak


class MicrobatchShardedGradSync(ShardedGradSync):
    """Stage 2, DeepSpeed's way (``--zero2-reduce-each-microbatch``): every micro-batch's gradients
    are reduce-scattered into the 1/dp shard as soon as a bucket is complete, and the bucket's
    full-size storage is released; the next micro-batch's gradients start in fresh storage.

    Peak gradient memory is then the shards plus the buckets of one backward still being filled or
    in flight, independent of the number of micro-batches m, at the price of m times the gradient
    traffic (m Psi (N-1)/N instead of Psi (N-1)/N). Shard accumulation: the first reduction of a
    step lands in the shard, later ones in a scratch shard that is added once it completes.

    Worked example, dp=2, m=2, one bucket of 6 elements: micro-batch 0's backward fills g0 (6),
    reduce-scatter(g0/2) -> shard (3), g0 freed; micro-batch 1 fills g1 (6, new storage),
    reduce-scatter(g1/2) -> scratch (3), g1 freed, shard += scratch. Most held at once: 6 + 3 + 3.
    """

    max_in_flight = 1                            # reductions overlapping backward (double buffering)

    def __init__(self, *args, **kwargs):
        self._in_flight: list[tuple[Bucket, object, torch.Tensor, torch.Tensor | None]] = []
        super().__init__(*args, **kwargs)

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """Every backward reduces: the countdown of this chunk's buckets starts over. A bucket some of
        whose parameters got no gradient last time keeps its storage and is reduced with this one.
        The previous backward's reductions have had a forward to complete: they are retired here,
        so no more than one backward's buckets are ever held."""
        self._synced = False
        self._retire(keep=0)
        for bucket in self.buckets:
            if bucket.chunk_id == chunk_id:
                bucket.pending, bucket.launched = len(bucket.slots), False

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        slot = self._slot_of[id(param)]
        bucket = slot.bucket
        view = self._ensure_grad_storage(bucket)[slot.start:slot.end]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.add_(param.grad.reshape(-1))
            param.grad = view.view_as(param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        grad_data = self._ensure_grad_storage(bucket)
        if self.dp_size > 1:
            grad_data.mul_(1.0 / self.dp_size)
        shard = self.grad_shards.get(id(bucket))
        scratch = None
        if shard is None:                        # the step's first reduction of this bucket
            shard = self.grad_shards[id(bucket)] = torch.empty(bucket.shard_size, dtype=grad_data.dtype,
                                                               device=grad_data.device)
            self._track(_nbytes(shard))
            target = shard
        else:
            target = scratch = torch.empty_like(shard)
            self._track(_nbytes(scratch))
        handle = comm.reduce_scatter(target, grad_data, self.dp_group, self.comm_log, "dp", async_op=True)
        for s in bucket.slots:                   # the next backward accumulates into fresh storage
            s.param.grad = None
        bucket.grad_data, bucket.launched = None, True
        self._in_flight.append((bucket, handle, grad_data, scratch))
        self._retire(keep=self.max_in_flight if self.cfg.overlap_grad_reduce else 0)

    def _retire(self, keep: int) -> None:
        """Finish reductions in launch order (add scratch shards, release full-size storage): every
        one seen complete, and the oldest ones until at most ``keep`` are in flight. (gloo's
        reduce-scatter never reports completion before it is waited on: there the bound decides.)"""
        while self._in_flight:
            bucket, handle, full, scratch = self._in_flight[0]
            if handle is not None:
                if len(self._in_flight) <= keep and not handle.is_completed():
                    return
                handle.wait()
            if scratch is not None:
                self.grad_shards[id(bucket)].add_(scratch)
                self._held -= _nbytes(scratch)
            self._held -= _nbytes(full)
            self._in_flight.pop(0)

    def finish_grad_sync(self) -> None:
        """Reduce what is left (buckets with gradients not yet reduced; buckets that got none this
        step reduce zeros so every rank holds a shard), then wait for everything."""
        for bucket in self.buckets:
            if bucket.grad_data is not None or id(bucket) not in self.grad_shards:
                self._start(bucket)
        self._retire(keep=0)
        self._reset_countdown()
        self._synced = True

    def zero_grad(self) -> None:
        self._retire(keep=0)
        super().zero_grad()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _weak_hook(grad_sync: _BucketedGradSync):
    """A parameter hook calling ``grad_sync._on_grad_ready`` without keeping ``grad_sync`` alive.

    Tensor hooks are held on the C++ side, where Python's garbage collector cannot see them: a
    hook bound to the grad sync (which holds the model) would make model, buffers and optimizer
    state uncollectable once the engine is dropped (a leak whenever a process builds several).
    """
    ref = weakref.ref(grad_sync)

    def hook(param: nn.Parameter) -> None:
        sync = ref()
        if sync is not None:
            sync._on_grad_ready(param)

    return hook


GRAD_SYNC_BY_STAGE = {0: AllReduceGradSync, 1: ReduceScatterGradSync, 2: ShardedGradSync}


def wrap_data_parallel(chunks, topo: Topology, zero_cfg: ZeroConfig, *, comm_log: CommLog | None = None,
                       grad_sync_cls: type | None = None) -> _BucketedGradSync:
    """The gradient synchroniser for ``zero_cfg.zero_stage`` (0, 1 or 2) over ``topo``'s DP group.

    ``grad_sync_cls`` overrides the stage's default class; the one useful override is
    ``AllReduceGradSync`` for stage 1: the ZeRO-1 optimizer only reads its shard, so an all-reduce
    works as well as a reduce-scatter. It sends 2 Psi (N-1)/N instead of Psi (N-1)/N for the
    gradients (3 Psi (N-1)/N per step with the parameter all-gather, vs 2 Psi (N-1)/N), but on gloo an
    all-reduce is ~2x faster than a reduce-scatter of the same buffer, so bench/bench_zero.py
    measures both. Pass the result as ``grad_sync`` to the pipeline schedule, call
    ``finalize_grads()`` after it, then the optimizer from
    :func:`megazero.parallel.zero.build_optimizer`.
    """
    cls = grad_sync_cls or GRAD_SYNC_BY_STAGE.get(zero_cfg.zero_stage)
    if zero_cfg.reduce_each_microbatch:
        if zero_cfg.zero_stage != 2 or grad_sync_cls is not None:
            raise ValueError(f"--zero2-reduce-each-microbatch applies to --zero-stage 2 only (got stage "
                             f"{zero_cfg.zero_stage}): drop the flag or use stage 2")
        cls = MicrobatchShardedGradSync
    if cls is None:
        raise ValueError(f"--zero-stage {zero_cfg.zero_stage} is not supported by data.py (0, 1 or 2)")
    return cls(chunks, topo, zero_cfg, comm_log=comm_log)


def finalize_grads(grad_sync: _BucketedGradSync) -> None:
    """Megatron's finalize_model_grads: DP sync, sequence-parallel grads over tp, tied embedding."""
    grad_sync.finalize_grads()
