"""Activation offload (``--cpu-offloading``): the tensors a layer saves for its backward wait in host
memory between its forward and its backward.

Per layer (:meth:`ActivationOffload.layer` around the layer's forward), every tensor autograd saves,
except the layer's own parameters (their storage stays where ZeRO keeps it), is copied to host memory
when it is saved and copied back when the backward reads it. On CUDA the copies out run on a side
stream into pinned memory, overlapping the forward (a tensor saved twice, e.g. the input both
projections keep, is sent once; the device tensors are released when the layer's forward ends); the backward of layer k starts the copy back of
layer k-1's tensors (the previous layer of the same forward) on that stream, so it overlaps layer k's
backward. On a CPU the same code runs with plain copies: the device is the host, so it saves nothing
there (the memory planner never picks it on a CPU), but the tests prove the mechanism.

Worked example, a chunk of 4 layers, ``--cpu-offloading-num-layers 2``: layers 0 and 1 send their
saved tensors to the host during the forward; in the backward, layer 1's are read back first (layer 1
runs its backward before layer 0) and reading them starts the copy of layer 0's. Layers 2 and 3 keep
theirs on the device. :attr:`ActivationOffload.bytes_offloaded` counts the bytes sent to the host.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class _Offloaded:
    """One saved tensor in host memory, and its way back."""

    __slots__ = ("stash", "host", "sent", "back", "ready")

    def __init__(self, stash: _LayerStash, host: torch.Tensor, sent):
        self.stash, self.host, self.sent = stash, host, sent
        self.back = self.ready = None


class _LayerStash:
    """The offloaded tensors of one layer's forward; ``previous``: the layer that ran before it in the
    same forward (its tensors are prefetched when this layer's backward starts reading)."""

    def __init__(self, owner: ActivationOffload, module: nn.Module, previous: _LayerStash | None):
        self.owner, self.module, self.previous = owner, module, previous
        self.items: list[_Offloaded] = []
        self.seen: dict[tuple, tuple[torch.Tensor, _Offloaded]] = {}
        self.param_storages: set[int] | None = None
        self.prefetched = False

    def pack(self, t: torch.Tensor):
        if self.param_storages is None:          # gathered now (ZeRO-3 gathers in the forward pre-hook)
            self.param_storages = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self.param_storages:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t._version)
        if key in self.seen:                     # saved twice (an input both projections keep): sent once
            return self.seen[key][1]
        owner = self.owner
        host = torch.empty_like(t, device="cpu", pin_memory=owner.stream is not None)     # t's strides
        sent = None
        if owner.stream is not None:
            owner.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(owner.stream):
                host.copy_(t, non_blocking=True)
                sent = torch.cuda.Event()
                sent.record(owner.stream)
            t.record_stream(owner.stream)
        else:
            host.copy_(t)
        owner.bytes_offloaded += host.numel() * host.element_size()
        item = _Offloaded(self, host, sent)
        self.items.append(item)
        self.seen[key] = (t, item)               # t kept until the layer's forward ends: no address reuse
        return item

    def unpack(self, item):
        if not isinstance(item, _Offloaded):
            return item
        owner = self.owner
        if self.previous is not None and not self.previous.prefetched:
            self.previous.prefetch()
        if item.back is None:
            item.stash._copy_back(item)
        if item.ready is not None:
            current = torch.cuda.current_stream(owner.device)
            current.wait_event(item.ready)
            item.back.record_stream(current)
            item.ready = None
        return item.back                         # freed with the graph node that saved it

    def prefetch(self) -> None:
        """Start copying every offloaded tensor of this layer back to the device."""
        self.prefetched = True
        for item in self.items:
            if item.back is None:
                self._copy_back(item)

    def _copy_back(self, item: _Offloaded) -> None:
        owner = self.owner
        if owner.stream is None:                 # on a CPU the host copy is the tensor
            item.back = item.host.to(owner.device)
        else:
            owner.stream.wait_event(item.sent)
            with torch.cuda.stream(owner.stream):
                item.back = item.host.to(owner.device, non_blocking=True)
                item.ready = torch.cuda.Event()
                item.ready.record(owner.stream)
        owner.bytes_reloaded += item.host.numel() * item.host.element_size()


class ActivationOffload:
    """The offloader of one model chunk; ``device``: where its activations live.

    ``with offload.layer(module): out = module(x)`` sends what ``module``'s forward saves to the host;
    :meth:`new_forward` starts a forward (a micro-batch), so prefetching follows that forward's layers.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.bytes_offloaded = 0                 # device -> host, counted as they are sent
        self.bytes_reloaded = 0                  # host -> device
        self._previous: _LayerStash | None = None

    def new_forward(self) -> None:
        self._previous = None

    @contextmanager
    def layer(self, module: nn.Module):
        stash = _LayerStash(self, module, self._previous)
        self._previous = stash
        try:
            with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
                yield
        finally:
            stash.seen.clear()                   # the device tensors may go now
