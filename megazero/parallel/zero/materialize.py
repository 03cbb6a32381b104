"""Sharded construction: a model built on the meta device gets each parameter's values where they live.

DeepSpeed's ``zero.Init`` and FSDP's meta-device init, for megazero: the trainer builds its chunks
with ``device="meta"`` (nothing allocated), and the grad sync's parameter component
(:mod:`.replicated_params`, :mod:`.param_sync`), while it lays the parameters out in buckets, swaps
every meta parameter for a real one whose storage is its place in the bucket (stages
0-2) or an empty tensor (stage 3), and asks the model for its initial value
(``chunk.initial_value(name)``, the model contract: the tp-local value, drawn layout-independently).

Peak memory of construction, per rank: stages 0-2, the rank's flat parameter buffers (its tp/pp
slice) plus one parameter's whole initial value; stage 3, its shards plus one gather unit's full
buffer (filled, sliced, freed) plus one parameter's whole initial value. The values are bitwise those
of building the model on a real device.
"""
from __future__ import annotations

import torch
from torch import nn


def is_meta(p: torch.Tensor) -> bool:
    return p.device.type == "meta"


def storage_device(p: torch.Tensor, rank_device: torch.device) -> torch.device:
    """Where a parameter's storage goes: its own device, or ``rank_device`` (this rank's) for a meta one."""
    return rank_device if is_meta(p) else p.device


def initial_value(chunk: nn.Module, name: str, p: nn.Parameter) -> torch.Tensor:
    """The value parameter ``name`` of ``chunk`` starts from: its current value, or for a parameter
    on the meta device the model's ``initial_value(name)``."""
    if not is_meta(p):
        return p.data
    init = getattr(chunk, "initial_value", None)
    if init is None:
        raise ValueError(f"parameter {name!r} is on the meta device but {type(chunk).__name__} has no "
                         f"initial_value(name): build it on a real device, or give the model one")
    return init(name)


def swap_in(chunk: nn.Module, name: str, meta: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """Replace ``chunk``'s meta parameter ``name`` by a real one holding ``data`` (same
    ``requires_grad`` and contract attributes); returns it. A real parameter gets ``data`` in place."""
    if not is_meta(meta):
        meta.data = data
        return meta
    owner, _, attr = name.rpartition(".")
    real = nn.Parameter(data, requires_grad=meta.requires_grad)
    real.__dict__.update(meta.__dict__)                 # tensor_parallel, partition_dim, ...
    setattr(chunk.get_submodule(owner) if owner else chunk, attr, real)
    return real
