"""Gradient synchronisation over a data-parallel group: the machinery every ZeRO stage shares, and
stages 0 and 1 (the sharded gradients of stages 2 and 3: :mod:`.sharded_grads`).

The pipeline schedule calls ``before_backward(chunk_id, is_last_microbatch)`` before every backward.
A hook on each parameter counts down its bucket (:mod:`~megazero.parallel.zero.buckets`); when the
bucket's last gradient of a reducing backward has arrived, its reduction is launched asynchronously,
overlapping the rest of backward; the sum is averaged over dp (stage 0 and fp16 buckets before the
reduction, the sharded stages on their kept range after it). At the end of each backward
the reductions the countdown did not launch (parameters that got no gradient, or overlap off) are
launched. ``finish_grad_sync()`` waits for everything; ``finalize_grads()`` adds the tensor- and
pipeline-parallel sums.

    class                 stage  reduces                     after the sync, this rank holds
    AllReduceGradSync     0      last micro-batch            the full averaged gradients
    ReduceScatterGradSync 1      last micro-batch            full-size buffer; only its shard is valid
    ShardedGradSync       2      last (or every) micro-batch only its 1/dp shard (sharded_grads.py)
    ShardedGradSync       3      every (or last) micro-batch only its 1/dp shard, with ShardedParams

A grad sync works over one :class:`~megazero.parallel.groups.DataParallel` view: the ZeRO engine builds
one per bucket group (dense parameters over dp, experts over the expert-data-parallel group), each over
the parameters of its group. Stages 0 and 1 keep one persistent gradient buffer per chunk, as
``param.grad`` views, so autograd accumulates micro-batches in place; where the parameters are narrower
than fp32 gradients, with gradient-accumulation fusion (``--gradient-accumulation-fusion``), each weight
gets its view as ``param.main_grad``, into which a linear's backward adds its weight gradient
(:mod:`megazero.parallel.wgrad_fusion`); the hook then only counts the bucket down.

Parameters are not the grad sync's: it is composed with a parameter component (``params``) that lays
the chunks out in buckets and holds their values, :class:`~.replicated_params.ReplicatedParams` at
stages 0-2 (always whole) or :class:`~.param_sync.ShardedParams` at stage 3 (a shard, gathered per
unit). The grad sync calls it where a step could need parameters gathered or released: at the end of
each backward (``after_backward``), around the W of a split backward (``before_weight_grad``,
``after_weight_grad``) and once the step's reductions are done (``after_grad_sync``).
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn

from megazero.config import ZeroConfig
from megazero.parallel import counted_comm as comm
from megazero.parallel import wgrad_fusion
from megazero.parallel.counted_comm import CommLog
from megazero.parallel.groups import DataParallel, PipelineLayout, TensorParallel
from megazero.parallel.params import attribute
from megazero.parallel.zero.buckets import Bucket, ParamSlot, nbytes, weak_grad_hook
from megazero.parallel.zero.replicated_params import ReplicatedParams


class GroupReplicaSum:
    """The replica dimension inside one job (``--data-parallel-replicas``): a reduced shard, already divided
    by the whole dp, is summed with the same shard of the other replicas (the ranks of ``replicas``, tag
    ``dp_replica``), giving the average over every data-parallel rank of every replica.

    A grad sync's ``replica_reducer`` is this or any object with the same ``combine(shard)`` (in place, on
    every bucket's held range once a step, in bucket order) and ``size`` (replicas averaged over, for the
    log): :class:`megazero.fault_tolerance.ManagerReplicaAverage` averages across torchft replica groups."""

    def __init__(self, replicas, comm_log: CommLog):
        self.group, self.size, self.comm_log = replicas.group, len(replicas.ranks), comm_log

    def combine(self, shard: torch.Tensor) -> None:
        comm.all_reduce(shard, self.group, self.comm_log, "dp_replica")


class BucketedGradSync:
    """The machinery every stage shares: buffers, buckets, hooks, the countdown, finalisation.

    Subclasses say how a bucket is reduced (:meth:`_launch`), where its gradient storage lives
    (:meth:`_grad_storage`) and where the reduced gradient of a bucket range is read
    (:meth:`reduced_grad`). ``dp``: the group to reduce over; ``tp`` and ``pipeline`` (default: one
    rank) for :meth:`finalize_grads`' sums of sequence-parallel and tied-embedding gradients;
    ``params``: the parameter component (default: :class:`ReplicatedParams`, see the module doc).
    """

    reduce_every_backward = False          # True: every backward reduces (not only the step's last)
    average_after = False                  # True: scale by 1/dp after the reduction, this rank's range only

    def __init__(self, chunks: nn.Module | list[nn.Module], dp: DataParallel, zero_cfg: ZeroConfig | None = None,
                 *, params=None, tp: TensorParallel | None = None, pipeline: PipelineLayout | None = None,
                 comm_log: CommLog | None = None):
        self.chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.dp = dp
        self.tp = tp or TensorParallel.single()
        self.pipeline = pipeline or PipelineLayout.single(dp.device)
        self.cfg = zero_cfg or ZeroConfig()
        self.comm_log = comm_log if comm_log is not None else CommLog()
        self.comm_log.ranks_per_node = self.comm_log.ranks_per_node or dp.ranks_per_node
        self.dp_group, self.dp_size, self.dp_rank = dp.group, dp.size, dp.rank
        # Gradients are averaged over this many ranks: dp, also for experts reduced over the smaller
        # expert-data-parallel group (each expert saw the tokens of all ep ranks: megazero.parallel.groups).
        self.average_over = dp.average_over
        self.buckets: list[Bucket] = []
        self.slots: list[ParamSlot] = []
        self._slot_of: dict[int, ParamSlot] = {}
        self.grad_buffers: list[torch.Tensor | None] = []
        self._reducing = [True] * len(self.chunks)
        self._fp32_grads = bool(self.cfg.accumulate_allreduce_grads_in_fp32)
        self._countdown_launches = self.cfg.overlap_grad_reduce or self.reduce_every_backward
        self._backward_of: dict[int, int] = {}      # chunk id -> graph task whose end is awaited
        self._input_only: set[int] = set()          # chunks in the I of a split backward (no gradients)
        self._weight_pass: set[int] = set()         # chunks in a W: it ends the backward itself
        self._synced = False
        self.on_reduced = None     # f(bucket, lo, hi): the reduced gradient of bucket elements [lo, hi) held
                                   # here just changed (an offloading optimizer copies it to the host)
        # --data-parallel-replicas: the sum over the other replicas' shards (GroupReplicaSum); the torchft
        # replica groups put their average across jobs here instead.
        self.replica_reducer = (GroupReplicaSum(dp.replicas, self.comm_log)
                                if dp.replicas is not None and len(dp.replicas.ranks) > 1 else None)
        self.params = params if params is not None else ReplicatedParams()
        self.params.attach(self)
        for chunk_id, chunk in enumerate(self.chunks):
            self._add_chunk(chunk_id, self.params.build_chunk(chunk_id, chunk, len(self.buckets)))
        self.params.install()
        self._reset_countdown()

    # ----------------------------------------------------------------- layout
    def _add_chunk(self, chunk_id: int, buckets: list[Bucket]) -> None:
        """Take a chunk's buckets as the parameter component laid them out: a gradient hook on every
        parameter, and the chunk's gradient storage."""
        for bucket in buckets:
            self.buckets.append(bucket)
            for slot in bucket.slots:
                self.slots.append(slot)
                self._slot_of[id(slot.param)] = slot
                slot.param.register_post_accumulate_grad_hook(weak_grad_hook(self))
        self.grad_buffers.append(self._make_grad_buffer(buckets) if buckets else None)
        for bucket in buckets:
            self._attach_grads(bucket)

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Gradients are accumulated and reduced in fp32 with ``accumulate_allreduce_grads_in_fp32``
        (Megatron's main grads), else in the parameters' dtype."""
        return torch.float32 if self._fp32_grads else param_dtype

    def _make_grad_buffer(self, buckets: list[Bucket]) -> torch.Tensor | None:
        """One persistent buffer for the chunk's buckets, laid out as its parameter buffer."""
        first = buckets[0].param_data
        return torch.zeros(sum(b.numel for b in buckets), dtype=self.grad_dtype(first.dtype), device=first.device)

    def _attach_grads(self, bucket: Bucket) -> None:
        """Point ``bucket.grad_data`` (and every ``param.grad`` of the bucket, when the dtypes agree, so
        autograd accumulates in place) at persistent storage."""
        buf = self.grad_buffers[bucket.chunk_id]
        bucket.grad_data = buf[bucket.offset:bucket.offset + bucket.numel]
        for s in bucket.slots:
            self._point_grad(s, bucket.grad_data)
            if self._fuses_wgrad(s, bucket.grad_data):
                wgrad_fusion.install_main_grad(s.param, bucket.grad_data[s.start:s.end])

    def _fuses_wgrad(self, slot: ParamSlot, storage: torch.Tensor) -> bool:
        """Does ``slot``'s parameter get its fp32 gradient target for gradient-accumulation fusion
        (:mod:`megazero.parallel.wgrad_fusion`)? Where the job asks for it and the storage's dtype is not
        the parameter's; never the tied word embedding, which has a second use in the same backward."""
        return (self.cfg.wgrad_into_main_grad and storage.dtype != slot.param.dtype
                and not attribute(slot.param, "shared_embedding"))

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

    def before_input_grad(self, chunk_id: int) -> None:
        """Called before the I of a split backward (zero-bubble schedules,
        :mod:`megazero.parallel.pipeline.split_backward`): it computes no parameter gradient, so its
        end reduces nothing; the micro-batch's :meth:`weight_grad` does."""
        self._input_only.add(chunk_id)
        self._reducing[chunk_id] = False
        self._synced = False

    @contextlib.contextmanager
    def weight_grad(self, chunk_id: int, is_last_microbatch: bool):
        """Bracket the W of a split backward: the parameters' gradients arrive through the same
        post-accumulate-grad hooks as in a full backward, so the bucket countdown launches each
        bucket's reduction when the last W touching it is done; leaving the block ends the backward
        (launches what the countdown did not) as the end of a full backward does. W runs several
        autograd passes, so the end is not left to autograd's end-of-backward callback."""
        self._input_only.discard(chunk_id)
        self.before_backward(chunk_id, is_last_microbatch)
        self._weight_pass.add(chunk_id)
        self.params.before_weight_grad(chunk_id)          # stage 3 gathers the chunk's parameters again
        try:
            yield
        finally:
            self._weight_pass.discard(chunk_id)
        self.params.after_weight_grad(chunk_id, is_last_microbatch)
        self._end_of_backward(chunk_id)

    def on_grad_ready(self, param: nn.Parameter) -> None:
        """A parameter's gradient of this backward is complete (its post-accumulate-grad hook)."""
        slot = self._slot_of[id(param)]
        bucket = slot.bucket
        if bucket.chunk_id not in self._input_only:  # in an I (its marked weights, a nested backward): I's own end counts
            self.watch_backward(bucket.chunk_id)
        storage = self._grad_storage(bucket)
        fused = wgrad_fusion.take_fused(param)       # a linear's backward added it to param.main_grad
        if not fused and param.grad is not None and param.grad.data_ptr() != storage[slot.start:slot.end].data_ptr():
            self._fold(slot, storage, param.grad)    # a fresh .grad: into the bucket
            self._point_grad(slot, storage)
        if self._reducing[bucket.chunk_id] and self._countdown_launches:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._start(bucket)

    def watch_backward(self, chunk_id: int) -> None:
        """Have :meth:`_end_of_backward` run once the backward in progress on ``chunk_id`` ends."""
        if chunk_id in self._weight_pass:
            return
        task = torch._C._current_graph_task_id()
        if task != -1 and self._backward_of.get(chunk_id) != task:
            self._backward_of[chunk_id] = task
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._end_of_backward, chunk_id))

    def is_reducing(self, chunk_id: int) -> bool:
        """Does the backward in progress (or the last one) on ``chunk_id`` reduce its gradients?"""
        return self._reducing[chunk_id]

    def _end_of_backward(self, chunk_id: int) -> None:
        """Tell the parameters, launch what the countdown did not, and start the countdown over for
        the next backward."""
        self.params.after_backward(chunk_id)
        self._backward_of.pop(chunk_id, None)
        if chunk_id in self._input_only:             # the I of a split backward: no gradient yet
            return
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
            self._sum_over_replicas(bucket, lo, hi)
            if self.average_over > 1 and self._averages_after(bucket.grad_data):
                bucket.grad_data[lo:hi].mul_(1.0 / self.average_over)
            self._reduced(bucket, lo, hi)
        self._reset_countdown()
        self._synced = True
        self.params.after_grad_sync()

    def _sum_over_replicas(self, bucket: Bucket, lo: int, hi: int) -> None:
        """The shard reduced within this replica, combined with the same shard of the other replicas by
        ``replica_reducer`` (``--data-parallel-replicas``' sum over the whole dp, or the torchft replica
        groups' average); nothing without replicas."""
        if self.replica_reducer is not None and lo < hi:
            self.replica_reducer.combine(self.reduced_grad(bucket, lo, hi))

    def _reduced(self, bucket: Bucket, lo: int, hi: int) -> None:
        if self.on_reduced is not None and lo < hi:
            self.on_reduced(bucket, lo, hi)

    def _reset_countdown(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.launched = len(bucket.slots), False

    # ------------------------------------------------------- after the sync
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
        if self.tp.size > 1:
            self._sum_segments([s for s in self.slots if attribute(s.param, "sequence_parallel_grad")],
                               self.tp.group, "tp")
        if self.pipeline.size > 1:
            shared = [s for s in self.slots if attribute(s.param, "shared_embedding")]
            if len(shared) == 2:                  # both ends on this rank (the V of zb-v): a local sum
                self._sum_local_pair(shared)
            elif shared:
                self._sum_segments(shared, self.pipeline.embedding.group, "emb")

    def _sum_local_pair(self, pair: list[ParamSlot]) -> None:
        """The tied embedding's original and its copy both on this rank (in two chunks, each in a
        bucket of its own of the same size, so this rank holds the same range of both): each gets
        the sum of the two reduced gradients, as the embedding group's all-reduce gives elsewhere."""
        a, b = (self.local_grad_segments(s) for s in pair)
        for x, y in zip(a, b):
            x.add_(y)
            y.copy_(x)
        for s in pair:
            lo, hi = self.grad_range(s.bucket)
            self._reduced(s.bucket, max(lo, s.start), min(hi, s.end))

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

    def close(self) -> None:
        """Release what outlives the object's memory (nothing here)."""

    def reset_peaks(self) -> None:
        """Restart the peak counts from now (the parameters' own; the sharded stages' gradient bytes)."""
        self.params.reset_peaks()


class AllReduceGradSync(BucketedGradSync):
    """Stage 0, plain data parallelism: every bucket is all-reduced (averaged) over dp."""

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        return comm.all_reduce(grad_data, self.dp_group, self.comm_log, self.dp.tag, async_op=True)


class ReduceScatterGradSync(BucketedGradSync):
    """Stage 1: reduce-scatter each bucket in place; only this rank's shard is read afterwards."""

    average_after = True

    def _launch(self, bucket: Bucket, grad_data: torch.Tensor):
        lo, hi = self.shard_range(bucket)
        return comm.reduce_scatter(grad_data[lo:hi], grad_data, self.dp_group, self.comm_log, self.dp.tag,
                                   async_op=True, input_is_scratch=True)

    def grad_range(self, bucket: Bucket) -> tuple[int, int]:
        return self.shard_range(bucket)
