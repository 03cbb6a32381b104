"""Flat, padded gradient buckets: the layout every ZeRO stage shares.

Layout. A model chunk's parameters are laid out flat in *reverse* registration order (roughly the
order backward produces their gradients) and cut into buckets of about ``bucket_size`` elements: a
parameter never straddles two buckets, and a parameter marked ``shared_embedding`` (the tied word
embedding) gets a bucket of its own so that its first- and last-stage copies line up. Every bucket is
padded so that it splits into ``dp`` equal, 64-element-aligned shards: dp rank r owns elements
``[r * shard_size, (r + 1) * shard_size)`` of every bucket.

Worked example, dp = 2, bucket_size = 5, three parameters w (6), b (3), ln (2) registered in that
order, pad multiple 1 for readability::

    bucket 0: ln[0:2] b[0:3] + pad 1      -> 6 elements, rank 0 owns [0, 3), rank 1 owns [3, 6)
    bucket 1: w[0:6]                       -> 6 elements, rank 0 owns w[0:3], rank 1 owns w[3:6]

Stages 0-2 make each parameter a view into one flat parameter buffer per chunk; stage 3 keeps one
bucket per gather unit and only its shard between uses (:mod:`megazero.parallel.zero.param_sync`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from megazero.config import FLAG
from megazero.parallel.params import attribute

PAD_MULTIPLE = 64  # elements per shard are a multiple of this (128-byte aligned in half precision)


@dataclass
class ParamSlot:
    """Where one parameter lives: elements [start, end) of bucket ``bucket``."""

    name: str
    param: nn.Parameter
    bucket: "Bucket"
    start: int
    end: int
    shape: torch.Size = torch.Size()
    filled: bool = True      # False: its gradient is not yet in the bucket storage (made unzeroed: ZeRO 2/3)


@dataclass
class Bucket:
    """A contiguous, padded range of one chunk's parameters, reduced as one collective.

    ``param_data``: the full-size parameter values (stages 0-2: a view into the chunk's buffer;
    stage 3: a buffer whose storage exists only while the unit is gathered). ``shard``: stage 3's
    persistent 1/dp slice. ``grad_data``: the full-size gradient storage, None while not allocated;
    ``grad_shard``: the reduced 1/dp gradient (stages 2 and 3). ``shard_size`` = numel / dp.
    """

    chunk_id: int
    index: int
    offset: int
    numel: int
    shard_size: int
    slots: list[ParamSlot] = field(default_factory=list)
    param_data: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    grad_data: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    pending: int = 0
    handle: object = None
    launched: bool = False

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """The elements dp rank ``dp_rank`` owns: [dp_rank * shard_size, (dp_rank + 1) * shard_size)."""
        return dp_rank * self.shard_size, (dp_rank + 1) * self.shard_size


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


def plan_params(named: list[tuple[str, nn.Parameter]], bucket_size: int, dp: int):
    """:func:`plan_buckets` for named parameters (in bucket-filling order)."""
    return plan_buckets([p.numel() for _, p in named], [bool(attribute(p, "shared_embedding")) for _, p in named],
                        bucket_size, dp)


def single_dtype(named: list[tuple[str, nn.Parameter]], chunk_id: int) -> torch.dtype:
    """The one dtype of a chunk's parameters (a flat buffer holds one dtype)."""
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise ValueError(f"model chunk {chunk_id} mixes parameter dtypes {sorted(map(str, dtypes))}: "
                         f"build the model in one dtype ({FLAG.bf16} / {FLAG.fp16} or fp32)")
    return dtypes.pop()


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def weak_grad_hook(grad_sync):
    """A post-accumulate-grad hook calling ``grad_sync.on_grad_ready(param)`` without keeping
    ``grad_sync`` alive.

    Tensor hooks are held on the C++ side, where Python's garbage collector cannot see them: a
    hook bound to the grad sync (which holds the model) would make model, buffers and optimizer
    state uncollectable once the engine is dropped (a leak whenever a process builds several).
    """
    ref = weakref.ref(grad_sync)

    def hook(param: nn.Parameter) -> None:
        sync = ref()
        if sync is not None:
            sync.on_grad_ready(param)

    return hook
