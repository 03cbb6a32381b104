"""The sharded gradients of stages 2 and 3: each rank keeps only its 1/dp shard of the reduced gradients.
Stage 3 is this same grad sync composed with sharded parameters (:class:`.param_sync.ShardedParams`,
the engine's stage table); stage 2's parameters are replicated (:class:`.replicated_params.ReplicatedParams`).

A bucket's full-size storage is allocated by its first gradient and detached from the parameters as
its reduction is launched (the next backward accumulates into fresh storage). The first reduction of a
step lands in the bucket's gradient shard; a later one (reducing every micro-batch) lands in a scratch
shard that is added once it completes. At most :func:`reductions_in_flight` reductions stay in flight;
older ones are waited on and their full storage released (where each holds an inbox, e.g. gloo at
dp > 2, before the next is launched, so no more than that many inboxes exist at once). Worked
example, dp = 2, 2 micro-batches reduced each, one bucket of 6 elements: micro-batch 0 fills g0 (6),
reduce-scatter(g0) -> shard (3), halved once it lands; micro-batch 1 fills g1 (6, new storage),
reduce-scatter(g1) -> scratch (3), shard += scratch / 2 once it lands.

Memory, honestly. Stage 2 reduces once per step, after the last micro-batch, so with gradient
accumulation every bucket holds its full storage from the first micro-batch's backward to its
reduction in the last one (a little more than stages 0/1 at the peak); what it saves is 2Ψ(N-1)/N
bytes outside backward (the optimizer step holds only shards, the next forward none). Reducing every
micro-batch (``--zero2-reduce-each-microbatch``) bounds the gradient peak by the shards plus the
buckets being filled or in flight, at m times the gradient traffic (m Ψ(N-1)/N instead of Ψ(N-1)/N).
:func:`backward_grad_bytes` is that accounting as a formula, which the memory estimator uses.
"""
from __future__ import annotations

from collections import deque

import torch

from megazero.config import ZeroConfig
from megazero.parallel.groups import DataParallel
from megazero.parallel.zero.buckets import Bucket, nbytes
from megazero.parallel.zero.grad_sync import BucketedGradSync
from megazero.parallel.zero.reducers import ReduceScatter

# Reductions that may still run while the next buckets fill: stage 2 keeps three; stage 3 one (a unit's
# gradient storage is a whole layer, and holding fewer is the point of the stage); none without overlap.
IN_FLIGHT_BY_STAGE = {2: 3, 3: 1}


def reductions_in_flight(stage: int, overlap_grad_reduce: bool) -> int:
    """The bound on gradient reductions in flight at ``stage`` (2 or 3)."""
    return IN_FLIGHT_BY_STAGE[stage] if overlap_grad_reduce else 0


def backward_grad_bytes(bucket_sizes: list[int], grad_bytes: int, n: int, stage: int, *, overlap: bool,
                        accumulates_full: bool, on_cuda: bool, reducer=ReduceScatter) -> int:
    """Most gradient bytes a sharded stage holds beyond its shards during a backward: with
    ``accumulates_full`` (stage 2 reducing once per step, or stage 3 keeping the parameters gathered
    over several micro-batches) every bucket's full storage; otherwise the bucket being filled and the
    largest ones in flight, each with a scratch shard and the reducer's inbox. ``bucket_sizes`` in
    elements, ``grad_bytes`` per element, ``n`` ranks sharing the buckets."""
    if accumulates_full:
        return grad_bytes * sum(bucket_sizes)
    in_flight = max(reductions_in_flight(stage, overlap), 1)
    largest = sorted(bucket_sizes)[-1 - in_flight:]          # the one being filled and those reducing
    total = sum(grad_bytes * x + grad_bytes * x // n for x in largest)
    return total + sum(reducer.inbox_bytes(grad_bytes * x, n, on_cuda) for x in largest[1:])


class ShardedGradSync(BucketedGradSync):
    """Stages 2 and 3: each rank keeps only its 1/dp shard of the reduced gradients (see the module doc).

    Components: ``reducer`` sums a bucket into this rank's shard (:mod:`.reducers`: the plain
    reduce-scatter, or qgZ's quantized hierarchical one); ``reduce_each_microbatch`` reduces after every
    micro-batch's backward instead of the step's last (DeepSpeed's stage 2, and stage 3 unless its
    parameters are kept gathered); ``max_in_flight`` bounds the reductions in flight (default
    ``reductions_in_flight(2, ...)``); ``params``, the parameter component (:mod:`.grad_sync`).

    Lifetimes, per bucket: the full-size storage from the bucket's first gradient until its
    reduce-scatter is retired; the gradient shard from the step's first reduction until
    ``zero_grad``. So the optimizer step holds only shards, the next forward holds no gradients at
    all, and backward holds the full storage of buckets not yet reduced. A retired storage is kept
    for the next bucket of its size until the backward's reductions are finished (fresh memory costs
    a page fault at every first touch): at most ``max_in_flight`` + 1 are kept, and they are freed
    before a storage of another size is allocated, so they never raise the peak.
    ``peak_grad_bytes`` records the most held at once.
    """

    average_after = True

    def __init__(self, chunks, dp: DataParallel, zero_cfg: ZeroConfig | None = None, *, reducer=None,
                 reduce_each_microbatch: bool = False, max_in_flight: int | None = None, **kwargs):
        self._in_flight: deque = deque()       # (bucket, handle, full storage, scratch shard or None)
        self._held = self._peak = 0
        self._spare: list[torch.Tensor] = []     # retired full-size storage for the next buckets of this backward
        self.reduce_every_backward = reduce_each_microbatch
        super().__init__(chunks, dp, zero_cfg, **kwargs)
        self.reducer = reducer if reducer is not None else ReduceScatter(dp, self.comm_log)
        self._max_in_flight = (max_in_flight if max_in_flight is not None
                               else reductions_in_flight(2, self.cfg.overlap_grad_reduce))

    def _make_grad_buffer(self, buckets: list[Bucket]) -> None:
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
        if self._max_in_flight and self.reducer.inbox_bytes(nbytes(grad_data), self.dp_size, grad_data.is_cuda):
            self._retire(keep=self._max_in_flight - 1)   # each holds an inbox: at most _max_in_flight at once
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
        handle = self.reducer.reduce_into(target, grad_data)
        for s in bucket.slots:                   # the next backward accumulates into fresh storage
            s.param.grad = None
        bucket.grad_data, bucket.launched = None, True
        self._in_flight.append((bucket, handle, grad_data, scratch))
        self._retire(keep=self._max_in_flight)

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
        zeros, so every rank holds a shard and every rank makes the same collectives), wait; then the
        parameters are told (stage 3's release what is still gathered)."""
        for bucket in self.buckets:
            if bucket.grad_data is not None or bucket.grad_shard is None:
                self._start(bucket)
        self._retire(keep=0)
        for bucket in self.buckets:                  # --data-parallel-replicas: once a step, on the final shard
            self._sum_over_replicas(bucket, *self.shard_range(bucket))
        self._drop_spares()
        self._reset_countdown()
        self._synced = True
        self.params.after_grad_sync()

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

    def reset_peaks(self) -> None:
        self._peak = self._held
        super().reset_peaks()
