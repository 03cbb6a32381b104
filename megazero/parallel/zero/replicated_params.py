"""The parameter component of ZeRO stages 0-2: every rank of a bucket group holds every parameter whole.

A grad sync (:mod:`.grad_sync`) is composed with one parameter component, which lays the chunks'
parameters out in buckets and says where their values are read and written; the grad sync calls it at
the points of a step where parameters could need gathering or releasing. Here they never do: each
parameter is a view of one flat buffer per chunk, always whole, so those calls do nothing. Stage 3's
component, which keeps only a shard and gathers per unit, is :class:`.param_sync.ShardedParams`.

Who holds what: each dp rank of the bucket group holds the whole tp-local parameters of its chunks
(``buffers``: one flat buffer per chunk, padded bucket by bucket, :mod:`.buckets`). Worked example,
dp = 2, bucket_size = 5, parameters w (6), b (3), ln (2), pad multiple 1: both ranks hold the buffer
``[ln0 ln1 b0 b1 b2 pad | w0 .. w5]`` (12 elements, two buckets) and ``w`` is a view of its last six.
The optimizer writes new values into the ranges it steps (stage 0 all of them, stages 1-2 its shard,
then all-gathered: :mod:`.publish`).
"""
from __future__ import annotations

import torch
from torch import nn

from megazero.parallel.zero.buckets import Bucket, ParamSlot, plan_params, single_dtype
from megazero.parallel.zero.materialize import initial_value, storage_device, swap_in


class ReplicatedParams:
    """Stages 0-2's parameters: views of one flat buffer per chunk, whole on every rank (module doc).

    The protocol a grad sync drives (:class:`.param_sync.ShardedParams` is the other side):
    ``attach(sync)``, ``build_chunk(chunk_id, chunk, first_index)`` -> the chunk's buckets, ``install()``;
    in a step ``after_backward``, ``before_weight_grad``, ``after_weight_grad``, ``after_grad_sync``;
    for the optimizer and the engine ``values``, ``held_range``, ``write``, ``flush``, ``on_device``,
    ``gather_all``, ``release``, ``release_all``, ``write_back``, ``reset_peaks``, ``accounting``."""

    on_device = True                           # the optimizer's ranges are device memory

    def __init__(self):
        self.buffers: list[torch.Tensor] = []      # one flat parameter buffer per chunk

    @classmethod
    def from_config(cls, zero_cfg, shards=None) -> "ReplicatedParams":
        """The component for a ZeRO config (nothing in it applies: no shards, no gathering)."""
        return cls()

    def attach(self, sync) -> None:
        """The grad sync this lays out parameters for: its dp view and bucket size."""
        self.dp, self.bucket_size = sync.dp, sync.cfg.bucket_size

    # ----------------------------------------------------------------- layout
    def build_chunk(self, chunk_id: int, chunk: nn.Module, first_index: int) -> list[Bucket]:
        """Lay ``chunk``'s trainable parameters out in buckets (reverse registration order) over one flat
        buffer and make each parameter a view of its place (a meta parameter gets its initial value
        there); returns the buckets, numbered from ``first_index``, with their slots."""
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad][::-1]
        if not named:
            self.buffers.append(torch.empty(0))
            return []
        dtype, device = single_dtype(named, chunk_id), storage_device(named[0][1], self.dp.device)
        plan = plan_params(named, self.bucket_size, self.dp.size)
        total = sum(padded for _, padded in plan)
        pbuf = torch.zeros(total, dtype=dtype, device=device)
        buckets, offset = [], 0
        for members, padded in plan:
            bucket = Bucket(chunk_id, first_index + len(buckets), offset, padded, padded // self.dp.size)
            bucket.param_data = pbuf[offset:offset + padded]
            for i, start, end in members:
                name, p = named[i]
                view = bucket.param_data[start:end].view(p.shape)
                with torch.no_grad():
                    view.copy_(initial_value(chunk, name, p))
                p = swap_in(chunk, name, p, view)            # the parameter now lives in the bucket
                bucket.slots.append(ParamSlot(name, p, bucket, start, end, p.shape))
            buckets.append(bucket)
            offset += padded
        self.buffers.append(pbuf)
        return buckets

    def install(self) -> None:
        """Every chunk is laid out (nothing runs at use time: the parameters are always whole)."""

    # -------------------------------------------------- the points of a step
    def after_backward(self, chunk_id: int) -> None:
        """A backward of ``chunk_id`` ended (before its remaining reductions are launched)."""

    def before_weight_grad(self, chunk_id: int) -> None:
        """The W of a split backward is about to run on ``chunk_id``."""

    def after_weight_grad(self, chunk_id: int, is_last_microbatch: bool) -> None:
        """The W of a split backward on ``chunk_id`` is done (before its end of backward)."""

    def after_grad_sync(self) -> None:
        """Every gradient reduction of the step is done."""

    # ---------------------------------------------- the optimizer, the engine
    def values(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """View of the model's values of bucket elements [lo, hi)."""
        return bucket.param_data[lo:hi]

    def held_range(self, bucket: Bucket) -> tuple[int, int]:
        """The bucket elements whose values this rank holds: all of them."""
        return 0, bucket.numel

    def write(self, bucket: Bucket, lo: int, hi: int, values: torch.Tensor) -> None:
        """Store ``values`` as the parameters of bucket elements [lo, hi)."""
        bucket.param_data[lo:hi].copy_(values, non_blocking=True)

    def flush(self) -> None:
        """The writes of a step are complete (they already are)."""

    def gather_all(self) -> list:
        """Make every parameter whole (it is); returns what :meth:`release` should free afterwards."""
        return []

    def release(self, unit) -> None:
        pass

    def release_all(self, chunk_id: int | None = None) -> None:
        pass

    def write_back(self) -> None:
        """Make the whole parameters' current values the truth (they are the only copy)."""

    def reset_peaks(self) -> None:
        """Restart the peak counts from now (none kept here)."""

    def accounting(self) -> dict[str, int]:
        """What ``model_state_bytes`` adds for these parameters beyond their buffers: nothing."""
        return {}
