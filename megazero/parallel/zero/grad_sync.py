"""Gradient synchronisation over the data-parallel group: one small class per ZeRO stage.

The pipeline schedule calls ``before_backward(chunk_id, is_last_microbatch)`` before every backward.
A hook on each parameter counts down its bucket (:mod:`~megazero.parallel.zero.buckets`); when the
bucket's last gradient of a reducing backward has arrived, its reduction is launched asynchronously,
overlapping the rest of backward; the sum is averaged over dp (stage 0 and fp16 buckets before the
reduction, the sharded stages on their kept range after it). At the end of each backward
the reductions the countdown did not launch (parameters that got no gradient, or overlap off) are
launched. ``finish_grad_sync()`` waits for everything; ``finalize_grads()`` adds the tensor- and
pipeline-parallel sums.

    class                      stage  reduces                 after the sync, this rank holds
    AllReduceGradSync          0      last micro-batch        the full averaged gradients
    ReduceScatterGradSync      1      last micro-batch        full-size buffer; only its shard is valid
    ShardedGradSync            2      last micro-batch        only its 1/dp shard
    MicrobatchShardedGradSync  2 (*)  every micro-batch       only its 1/dp shard
    ShardedParamSync           3      every micro-batch (**)  only its 1/dp shard (param_sync.py)

(*) ``--zero2-reduce-each-microbatch``, DeepSpeed's stage 2. (**) or the last only with
``--zero3-keep-params-gathered``.

Sharded gradients (stages 2 and 3) share one mechanism. A bucket's full-size storage is allocated by
its first gradient and detached from the parameters as its reduce-scatter is launched (the next
backward accumulates into fresh storage). The first reduction of a step lands in the bucket's
gradient shard; a later one (reducing every micro-batch) lands in a scratch shard that is added once
it completes. At most ``MAX_REDUCTIONS_IN_FLIGHT`` reductions stay in flight; older ones are waited
on and their full storage released (on gloo at dp > 2, where each holds an inbox, before the next is
launched, so no more than that many inboxes exist at once). Worked example, dp = 2, 2 micro-batches
reduced each, one bucket of 6 elements: micro-batch 0 fills g0 (6), reduce-scatter(g0) -> shard (3),
halved once it lands; micro-batch 1 fills g1 (6, new storage), reduce-scatter(g1) -> scratch (3),
shard += scratch / 2 once it lands.

Memory, honestly. Stage 2 reduces once per step, after the last micro-batch, so with gradient
accumulation every bucket holds its full storage from the first micro-batch's backward to its
reduction in the last one (a little more than stages 0/1 at the peak); what it saves is 2Ψ(N-1)/N
bytes outside backward (the optimizer step holds only shards, the next forward none). Reducing every
micro-batch bounds the gradient peak by the shards plus the buckets being filled or in flight, at m
times the gradient traffic (m Ψ(N-1)/N instead of Ψ(N-1)/N).
"""
from __future__ import annotations

from collections import deque
from functools import partial

import torch
import torch.nn as nn

from megazero.config import ZeroConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.params import attribute
from megazero.parallel.topology import Topology
from megazero.parallel.zero.buckets import Bucket, ParamSlot, nbytes, plan_params, single_dtype, weak_grad_hook
from megazero.parallel.zero.materialize import initial_value, is_meta, swap_in

MAX_REDUCTIONS_IN_FLIGHT = 3   # stage 2's gradient reductions that may still run while the next buckets fill (stage 3: 1)


class BucketedGradSync:
    """The machinery every stage shares: buffers, buckets, hooks, the countdown, finalisation.

    Subclasses say how a bucket is reduced (:meth:`_launch`), where its gradient storage lives
    (:meth:`_grad_storage`) and where the reduced gradient of a bucket range is read
    (:meth:`reduced_grad`). Stages 0 and 1 keep one persistent gradient buffer per chunk, as
    ``param.grad`` views, so autograd accumulates micro-batches in place.
    """

    reduce_every_backward = False          # True: every backward reduces (not only the step's last)
    average_after = False                  # True: scale by 1/dp after the reduction, this rank's range only

    def __init__(self, chunks: nn.Module | list[nn.Module], topo: Topology, zero_cfg: ZeroConfig | None = None,
                 *, comm_log: CommLog | None = None):
        self.chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.topo = topo
        self.cfg = zero_cfg or ZeroConfig()
        self.comm_log = comm_log if comm_log is not None else CommLog()
        self.comm_log.ranks_per_node = self.comm_log.ranks_per_node or getattr(topo, "ranks_per_node", None)
        self.dp_group, self.dp_size, self.dp_rank = topo.dp_group, topo.dp_size, topo.dp_rank
        # Gradients are averaged over this many ranks: dp, also for experts reduced over the smaller
        # expert-data-parallel group (each expert saw the tokens of all ep ranks: zero/experts.py).
        self.average_over = getattr(topo, "gradient_average_size", self.dp_size)
        self.buckets: list[Bucket] = []
        self.slots: list[ParamSlot] = []
        self._slot_of: dict[int, ParamSlot] = {}
        self.param_buffers: list[torch.Tensor] = []
        self.grad_buffers: list[torch.Tensor | None] = []
        self._reducing = [True] * len(self.chunks)
        self._fp32_grads = bool(self.cfg.accumulate_allreduce_grads_in_fp32)
        self._countdown_launches = self.cfg.overlap_grad_reduce or self.reduce_every_backward
        self._backward_of: dict[int, int] = {}      # chunk id -> graph task whose end is awaited
        self._synced = False
        self.on_reduced = None     # f(bucket, lo, hi): the reduced gradient of bucket elements [lo, hi) held
                                   # here just changed (an offloading optimizer copies it to the host)
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
        dtype, device = single_dtype(named, chunk_id), self.device_of(named[0][1])
        plan = plan_params(named, self.cfg.bucket_size, self.dp_size)
        total = sum(padded for _, padded in plan)
        pbuf = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for members, padded in plan:
            bucket = Bucket(chunk_id, len(self.buckets), offset, padded, padded // self.dp_size)
            bucket.param_data = pbuf[offset:offset + padded]
            for i, start, end in members:
                name, p = named[i]
                view = bucket.param_data[start:end].view(p.shape)
                with torch.no_grad():
                    view.copy_(initial_value(chunk, name, p))
                p = swap_in(chunk, name, p, view)            # the parameter now lives in the bucket
                self._add_slot(ParamSlot(name, p, bucket, start, end, p.shape))
            self.buckets.append(bucket)
            offset += padded
        self.param_buffers.append(pbuf)
        self.grad_buffers.append(self._make_grad_buffer(total, self.grad_dtype(dtype), device))
        for bucket in self.buckets:
            if bucket.chunk_id == chunk_id:
                self._attach_grads(bucket)

    def device_of(self, p: nn.Parameter) -> torch.device:
        """Where a parameter's storage goes: its own device, or this rank's for a meta parameter."""
        return self.topo.device if is_meta(p) else p.device

    def _add_slot(self, slot: ParamSlot) -> None:
        slot.bucket.slots.append(slot)
        self.slots.append(slot)
        self._slot_of[id(slot.param)] = slot
        slot.param.register_post_accumulate_grad_hook(weak_grad_hook(self))

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Gradients are accumulated and reduced in fp32 with ``accumulate_allreduce_grads_in_fp32``
        (Megatron's main grads), else in the parameters' dtype."""
        return torch.float32 if self._fp32_grads else param_dtype

    def _make_grad_buffer(self, total: int, dtype, device) -> torch.Tensor | None:
        return torch.zeros(total, dtype=dtype, device=device)

    def _attach_grads(self, bucket: Bucket) -> None:
        """Point ``bucket.grad_data`` (and every ``param.grad`` of the bucket, when the dtypes agree, so
        autograd accumulates in place) at persistent storage."""
        buf = self.grad_buffers[bucket.chunk_id]
        bucket.grad_data = buf[bucket.offset:bucket.offset + bucket.numel]
        for s in bucket.slots:
            self._point_grad(s, bucket.grad_data)

    @staticmethod
    def _point_grad(slot: ParamSlot, storage: torch.Tensor) -> None:
        """``param.grad`` becomes its view of ``storage`` when they share a dtype; otherwise (fp32
        storage for bf16 parameters) autograd makes a fresh gradient each backward, which the hook
        folds into the storage and drops."""
        view = storage[slot.start:slot.end]
        slot.param.grad = view.view_as(slot.param) if view.dtype == slot.param.dtype else None

    def _grad_storage(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's full-size gradient storage (allocated on demand by the sharded stages)."""
        return bucket.grad_data

    def _holds_grads(self, bucket: Bucket) -> bool:
        return True

    @staticmethod
    def _fold(slot: ParamSlot, storage: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a gradient autograd made on its own (or copy it, the first into storage not zeroed)."""
        view = storage[slot.start:slot.end]
        view.add_(grad.reshape(-1)) if slot.filled else view.copy_(grad.reshape(-1))
        slot.filled = True

    # ------------------------------------------------------------- backward
    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """Called by the schedule before each backward of ``chunk_id``: does this one reduce?"""
        self._reducing[chunk_id] = is_last_microbatch or self.reduce_every_backward
        self._synced = False

    def on_grad_ready(self, param: nn.Parameter) -> None:
        """A parameter's gradient of this backward is complete (its post-accumulate-grad hook)."""
        slot = self._slot_of[id(param)]
        bucket = slot.bucket
        self._watch_backward(bucket.chunk_id)
        storage = self._grad_storage(bucket)
        if param.grad is not None and param.grad.data_ptr() != storage[slot.start:slot.end].data_ptr():
            self._fold(slot, storage, param.grad)    # a fresh .grad: into the bucket
            self._point_grad(slot, storage)
        if self._reducing[bucket.chunk_id] and self._countdown_launches:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._start(bucket)

    def _watch_backward(self, chunk_id: int) -> None:
        """Have :meth:`_end_of_backward` run once the backward in progress on ``chunk_id`` ends."""
        task = torch._C._current_graph_task_id()
        if task != -1 and self._backward_of.get(chunk_id) != task:
            self._backward_of[chunk_id] = task
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._end_of_backward, chunk_id))

    def _end_of_backward(self, chunk_id: int) -> None:
        """Launch what the countdown did not, and start the countdown over for the next backward."""
        self._backward_of.pop(chunk_id, None)
        for bucket in self.buckets:
            if bucket.chunk_id != chunk_id:
                continue
            if self._reducing[chunk_id] and not bucket.launched and self._holds_grads(bucket):
                self._start(bucket)
            bucket.pending = len(bucket.slots)
            if self.reduce_every_backward:
                bucket.launched = False

    def _start(self, bucket: Bucket) -> None:
        grad_data = self._grad_storage(bucket)
        if self.average_over > 1 and not self._averages_after(grad_data):
            grad_data.mul_(1.0 / self.average_over)
        bucket.handle = self._launch(bucket, grad_data)
        bucket.launched = True

    def _averages_after(self, grad_data: torch.Tensor) -> bool:
        """Average the reduced range, not the whole bucket before (1/N of the multiplies where only a
        shard is kept, and bitwise the same for N a power of two). fp16 sums of N unscaled gradients
        could overflow, so fp16 buckets are averaged first, as stage 0's (read whole) always are."""
        return self.average_after and grad_data.dtype != torch.float16

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        raise NotImplementedError

    def finish_grad_sync(self) -> None:
        """Launch what backward did not (e.g. a chunk with no backward), wait for everything."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._start(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle = None
            lo, hi = self.grad_range(bucket)
            if self.average_over > 1 and self._averages_after(bucket.grad_data):
                bucket.grad_data[lo:hi].mul_(1.0 / self.average_over)
            self._reduced(bucket, lo, hi)
        self._reset_countdown()
        self._synced = True

    def _reduced(self, bucket: Bucket, lo: int, hi: int) -> None:
        if self.on_reduced is not None and lo < hi:
            self.on_reduced(bucket, lo, hi)

    def _reset_countdown(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.launched = len(bucket.slots), False

    # ------------------------------------------------------- after the sync
    def param_values(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """View of the model's values of bucket elements [lo, hi)."""
        return bucket.param_data[lo:hi]

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """The bucket elements this DP rank owns in ZeRO: [dp_rank * shard, (dp_rank + 1) * shard)."""
        return bucket.shard_range(self.dp_rank)

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
        """Megatron's finalize_model_grads: finish the DP reduction, then sum the partial grads of
        parameters marked ``sequence_parallel_grad`` over tp, and the tied embedding's grads over the
        embedding group (first + last pipeline stage).

        Both extra sums act on the reduced gradients this rank holds; tp peers and the two embedding
        stages have identical bucket layouts for those parameters (the tied embedding sits in a
        bucket of its own), so the shards line up and the sums commute with the DP average.
        """
        self.finish_grad_sync()
        if self.topo.tp_size > 1:
            self._sum_segments([s for s in self.slots if attribute(s.param, "sequence_parallel_grad")],
                               self.topo.tp_group, "tp")
        if self.topo.pp_size > 1:
            shared = [s for s in self.slots if attribute(s.param, "shared_embedding")]
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
        for s in slots:
            lo, hi = self.grad_range(s.bucket)
            self._reduced(s.bucket, max(lo, s.start), min(hi, s.end))

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
        return sum(nbytes(t) for t in self.held_grad_tensors())

    def offloaded_bytes(self) -> dict[str, int]:
        """Model state kept off the device (stage 3's offloaded parameter shards: ``param_sync``)."""
        return {}

    def close(self) -> None:
        """Release what outlives the object's memory (swap files: ``param_sync``)."""


class AllReduceGradSync(BucketedGradSync):
    """Stage 0, plain data parallelism: every bucket is all-reduced (averaged) over dp."""

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        return comm.all_reduce(grad_data, self.dp_group, self.comm_log, "dp", async_op=True)


class ReduceScatterGradSync(BucketedGradSync):
    """Stage 1: reduce-scatter each bucket in place; only this rank's shard is read afterwards."""

    average_after = True

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        lo, hi = self.shard_range(bucket)
        return comm.reduce_scatter(grad_data[lo:hi], grad_data, self.dp_group, self.comm_log, "dp",
                                   async_op=True, input_is_scratch=True)

    def grad_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.shard_range(bucket)


class ShardedGradSync(BucketedGradSync):
    """Stage 2: each rank keeps only its 1/dp shard of the reduced gradients (see the module doc).

    Lifetimes, per bucket: the full-size storage from the bucket's first gradient until its
    reduce-scatter is retired; the gradient shard from the step's first reduction until
    ``zero_grad``. So the optimizer step holds only shards, the next forward holds no gradients at
    all, and backward holds the full storage of buckets not yet reduced. A retired storage is kept
    for the next bucket of its size until the backward's reductions are finished (fresh memory costs
    a page fault at every first touch): at most ``MAX_REDUCTIONS_IN_FLIGHT`` + 1 are kept, and they
    are freed before a storage of another size is allocated, so they never raise the peak.
    ``peak_grad_bytes`` records the most held at once.
    """

    average_after = True

    def __init__(self, *args, **kwargs):
        self._in_flight: deque = deque()       # (bucket, handle, full storage, scratch shard or None)
        self._held = self._peak = 0
        self._spare: list[torch.Tensor] = []     # retired full-size storage for the next buckets of this backward
        super().__init__(*args, **kwargs)
        self._max_in_flight = MAX_REDUCTIONS_IN_FLIGHT if self.cfg.overlap_grad_reduce else 0

    def _make_grad_buffer(self, total: int, dtype, device) -> None:
        return None

    def _attach_grads(self, bucket: Bucket) -> None:
        pass                                     # nothing persistent: see the class docstring

    def _track(self, nbytes_delta: int) -> None:
        self._held += nbytes_delta
        self._peak = max(self._peak, self._held)

    def _grad_storage(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's full-size storage, made by its first gradient of a backward and not zeroed:
        each parameter's first gradient is copied in (its ``.grad`` stays unset until then, so
        autograd hands it over instead of adding it to garbage), later ones added in place;
        the padding is zeroed here, parameters that got no gradient as the reduction is launched."""
        if bucket.grad_data is None:
            bucket.grad_data = storage = self._fresh_storage(bucket)
            self._track(nbytes(storage))
            covered = 0
            for s in sorted(bucket.slots, key=lambda s: s.start):
                storage[covered:s.start].zero_()
                covered = s.end
            storage[covered:].zero_()
            for s in bucket.slots:
                s.filled = False
                if s.param.grad is not None:          # a gradient autograd made before we saw it
                    self._fold(s, storage, s.param.grad)
                    self._point_grad(s, storage)
        return bucket.grad_data

    def _fill_unwritten(self, bucket: Bucket) -> None:
        """Zeros for the parameters of ``bucket`` that got no gradient since its storage was made."""
        for s in bucket.slots:
            if not s.filled:
                bucket.grad_data[s.start:s.end].zero_()
                s.filled = True

    def _fresh_storage(self, bucket: Bucket) -> torch.Tensor:
        """Full-size gradient storage for ``bucket``, contents undefined: a retired bucket's storage of
        the same size when one is spare (the allocator would hand back fresh pages to fault in), else new."""
        dtype, device = self.grad_dtype(bucket.param_data.dtype), bucket.param_data.device
        # A generator, not a for loop: no loop variable is left holding a spare past the allocation below.
        fit = next((i for i, t in enumerate(self._spare)
                    if t.numel() == bucket.numel and t.dtype == dtype and t.device == device), None)
        if fit is not None:
            self._held -= nbytes(self._spare[fit])   # counted again by the caller, as a bucket's storage
            return self._spare.pop(fit)
        self._drop_spares()                      # of other sizes: freed before anything new is allocated
        return torch.empty(bucket.numel, dtype=dtype, device=device)

    def _drop_spares(self) -> None:
        self._held -= sum(nbytes(t) for t in self._spare)
        self._spare.clear()

    def _holds_grads(self, bucket: Bucket) -> bool:
        return bucket.grad_data is not None

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """The previous backward's reductions have had a forward to complete: retire them here."""
        super().before_backward(chunk_id, is_last_microbatch)
        self._retire(keep=0)

    def _start(self, bucket: Bucket) -> None:
        """Reduce-scatter the bucket into its gradient shard (or a scratch shard added on arrival),
        detach its storage from the parameters, keep the number in flight bounded."""
        grad_data = self._grad_storage(bucket)
        if self._max_in_flight and not grad_data.is_cuda and self.dp_size > 2:
            self._retire(keep=self._max_in_flight - 1)   # gloo: each takes an inbox; at most _max_in_flight at once
        self._fill_unwritten(bucket)
        if self.average_over > 1 and not self._averages_after(grad_data):
            grad_data.mul_(1.0 / self.average_over)
        scratch = None
        if bucket.grad_shard is None:            # the step's first reduction of this bucket
            bucket.grad_shard = target = torch.empty(bucket.shard_size, dtype=grad_data.dtype,
                                                     device=grad_data.device)
            self._track(nbytes(target))
        else:
            target = scratch = torch.empty_like(bucket.grad_shard)
            self._track(nbytes(scratch))
        handle = self.reduce_scatter_grads(target, grad_data)
        for s in bucket.slots:                   # the next backward accumulates into fresh storage
            s.param.grad = None
        bucket.grad_data, bucket.launched = None, True
        self._in_flight.append((bucket, handle, grad_data, scratch))
        self._retire(keep=self._max_in_flight)

    def reduce_scatter_grads(self, target: torch.Tensor, grad_data: torch.Tensor):
        """Sum ``grad_data`` over dp into ``target``, this rank's shard (ZeRO++'s qgZ: :mod:`.zeropp`).
        On gloo at dp > 2 each takes an inbox of (N-2)/N of the bucket, so :meth:`_start` lets at most
        ``_max_in_flight`` run at once there (elsewhere one more, briefly: the new one beside the others)."""
        return comm.reduce_scatter(target, grad_data, self.dp_group, self.comm_log, "dp", async_op=True,
                                   input_is_scratch=True, inbox=True)

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
            if self.average_over > 1 and self._averages_after(full):
                (bucket.grad_shard if scratch is None else scratch).mul_(1.0 / self.average_over)
            if scratch is not None:
                bucket.grad_shard.add_(scratch)
                self._held -= nbytes(scratch)
            if len(self._spare) <= self._max_in_flight:
                self._spare.append(full)             # still held: counted until reused or dropped
            else:
                self._held -= nbytes(full)
            self._in_flight.popleft()
            self._reduced(bucket, *self.shard_range(bucket))

    def finish_grad_sync(self) -> None:
        """Reduce what is left (gradients not yet reduced; buckets that got none this step reduce
        zeros, so every rank holds a shard and every rank makes the same collectives), wait."""
        for bucket in self.buckets:
            if bucket.grad_data is not None or bucket.grad_shard is None:
                self._start(bucket)
        self._retire(keep=0)
        self._drop_spares()
        self._reset_countdown()
        self._synced = True

    def grad_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.shard_range(bucket)

    def reduced_grad(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        base = self.dp_rank * bucket.shard_size
        if lo < base or hi > base + bucket.shard_size:
            raise IndexError(f"rank {self.dp_rank} holds the gradients of bucket elements [{base}, "
                             f"{base + bucket.shard_size}), asked for [{lo}, {hi})")
        return bucket.grad_shard[lo - base:hi - base]

    def zero_grad(self) -> None:
        self._retire(keep=0)
        self._drop_spares()
        for bucket in self.buckets:
            if bucket.grad_data is not None:     # normally released when its reduction is launched
                self._held -= nbytes(bucket.grad_data)
                bucket.grad_data = None
                for s in bucket.slots:
                    s.param.grad = None
            if bucket.grad_shard is not None:
                self._held -= nbytes(bucket.grad_shard)
                bucket.grad_shard = None
        self._synced = False

    def held_grad_tensors(self) -> list[torch.Tensor]:
        shards = [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        full = [b.grad_data for b in self.buckets if b.grad_data is not None]
        return shards + full + self._spare + [f[2] for f in self._in_flight] + [f[3] for f in self._in_flight
                                                                   if f[3] is not None]

    @property
    def peak_grad_bytes(self) -> int:
        return self._peak


class MicrobatchShardedGradSync(ShardedGradSync):
    """Stage 2, DeepSpeed's way (``--zero2-reduce-each-microbatch``): every micro-batch's gradients are
    reduce-scattered into the 1/dp shard as soon as a bucket is complete, and the bucket's full-size
    storage released. Peak gradient memory: the shards plus the buckets of one backward being
    filled or in flight, independent of the number of micro-batches m, at m times the traffic."""

    reduce_every_backward = True


GRAD_SYNC_BY_STAGE = {0: AllReduceGradSync, 1: ReduceScatterGradSync, 2: ShardedGradSync}


def wrap_data_parallel(chunks, topo: Topology, zero_cfg: ZeroConfig, *, comm_log: CommLog | None = None,
                       grad_sync_cls: type | None = None) -> BucketedGradSync:
    """The gradient synchroniser for ``zero_cfg.zero_stage`` (0, 1 or 2) over ``topo``'s DP group.

    ``grad_sync_cls`` overrides the stage's default class; the one useful override is
    ``AllReduceGradSync`` for stage 1: the ZeRO-1 optimizer only reads its shard, so an all-reduce
    works as well as a reduce-scatter. It sends 2Ψ(N-1)/N instead of Ψ(N-1)/N for the gradients
    (3Ψ(N-1)/N per step with the parameter all-gather, vs 2Ψ(N-1)/N); bench/bench_zero.py measures
    both.
    """
    cls = grad_sync_cls or GRAD_SYNC_BY_STAGE.get(zero_cfg.zero_stage)
    if zero_cfg.reduce_each_microbatch:
        if zero_cfg.zero_stage != 2 or grad_sync_cls is not None:
            raise ValueError(f"--zero2-reduce-each-microbatch applies to --zero-stage 2 only (got stage "
                             f"{zero_cfg.zero_stage}): drop the flag or use stage 2")
        cls = MicrobatchShardedGradSync
    if cls is None:
        raise ValueError(f"--zero-stage {zero_cfg.zero_stage}: wrap_data_parallel builds stages 0, 1 and 2")
    return cls(chunks, topo, zero_cfg, comm_log=comm_log)
