"""Small wrappers over torch.distributed collectives used by the parallel layers.

Every helper treats ``group=None`` or a group of one rank as "no communication" and returns its
input unchanged (or a plain copy where a new tensor is needed), so tp=1 code paths never touch
``torch.distributed`` and run without an initialised process group.

torch 2.13 renamed the flat-tensor collectives (``all_gather_into_tensor`` ->
``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``) and warns on the old
names; we use the new names when present so the same code runs without warnings from torch 2.4 on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# (output, input, group=..., async_op=...) flat-tensor collectives, whichever name this torch has.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``x`` over ``group`` (no-op at size 1); returns ``x``."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, in group-rank order: [n, ...] -> [size * n, ...]."""
    size = group_size(group)
    return x if size == 1 else _flat_dim0(all_gather_flat, x, size * x.shape[0], group)


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's dim-0 chunk: [size * n, ...] -> [n, ...]."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"reduce-scatter over {size} ranks needs dim 0 ({x.shape[0]}) divisible by {size}")
    return _flat_dim0(reduce_scatter_flat, x, x.shape[0] // size, group)


def _flat_dim0(collective, x: torch.Tensor, out_rows: int, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((out_rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    collective(out, x, group=group)
    return out


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in group-rank order."""
    size = group_size(group)
    if size == 1:
        return x
    gathered = all_gather_dim0(x.movedim(-1, 0), group)           # [size * n, ...]
    return gathered.movedim(0, -1).contiguous()
