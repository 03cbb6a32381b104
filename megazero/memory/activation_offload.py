"""Activation offload (``--cpu-offloading``): the tensors a layer saves for its backward wait in host
memory between its forward and its backward.

Per layer (:meth:`ActivationOffload.layer` around the layer's forward), every tensor autograd saves,
except the layer's own parameters (their storage stays where ZeRO keeps it), is copied to host memory
when it is saved and copied back when the backward reads it, storage by storage: views of one
storage (the input both projections keep; attention's output and the reshape the next layer reads)
go once and come back as views of one copy. On CUDA the copies out run on a side stream into pinned
memory, overlapping the forward (the device tensors are released when the layer's forward ends); the
backward of layer k starts the copy back of layer k-1's storages (the previous layer of the same
forward) on that stream, so it overlaps layer k's backward. The host copies live as long as the
graph holds the saved tensors, no longer. On a CPU the same code runs with plain copies: the device is the host, so it saves nothing
there (the memory planner never picks it on a CPU), but the tests prove the mechanism.

Worked example, a chunk of 4 layers, ``--cpu-offloading-num-layers 2``: layers 0 and 1 send their
saved tensors to the host during the forward; in the backward, layer 1's are read back first (layer 1
runs its backward before layer 0) and reading them starts the copy of layer 0's. Layers 2 and 3 keep
theirs on the device. :attr:`ActivationOffload.bytes_offloaded` counts the bytes sent to the host.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn


class _HostStorage:
    """One device storage's bytes in host memory, and its way back. Held by the saved tensors that view
    it (:class:`_Offloaded`), so it lives exactly as long as the graph needs one of them."""

    def __init__(self, host: torch.Tensor, sent):
        self.host, self.sent = host, sent        # uint8 [nbytes]; the copy's CUDA event (None on a CPU)
        self.back = self.ready = None            # the device copy and its event, once copied back


class _Offloaded:
    """A saved tensor: a view (dtype, shape, strides, offset) of an offloaded storage."""

    __slots__ = ("dtype", "offset", "shape", "storage", "stride")

    def __init__(self, storage: _HostStorage, t: torch.Tensor):
        self.storage, self.dtype, self.shape = storage, t.dtype, t.shape
        self.stride, self.offset = t.stride(), t.storage_offset()


def _same_storage(kept: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` views the very storage ``kept`` still holds. An address alone is not enough: selective
    recompute frees a saved output's storage in the forward (``free_until_backward`` resizes it to 0
    bytes), and the allocator may hand that address to the next tensor the layer saves."""
    storage = kept.untyped_storage()
    return storage.nbytes() > 0 and storage.data_ptr() == t.untyped_storage().data_ptr() \
        and storage.nbytes() == t.untyped_storage().nbytes()


class _LayerStash:
    """The offloaded storages of one layer's forward; ``previous``: the layer that ran before it in the
    same forward (its storages are prefetched when this layer's backward starts reading). Holds its
    storages weakly: once the graph has used them they go, whatever keeps the stash."""

    def __init__(self, owner: ActivationOffload, module: nn.Module, previous: _LayerStash | None):
        self.owner, self.module, self.previous = owner, module, previous
        self.storages: list[weakref.ref] = []
        self.seen: dict[int, tuple[torch.Tensor, _HostStorage, int]] = {}   # by device address: (tensor,
        # its copy, the storage's version then: a view written since is sent again)
        self.prefetched = False

    def pack(self, t: torch.Tensor):
        # where the parameters are now: ZeRO-3 gathers a layer's units as their modules are called
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        address = t.untyped_storage().data_ptr()
        if (isinstance(t, nn.Parameter) or address in params
                or t.device.type != self.owner.device.type):      # a parameter, or already on the host
            return t
        kept = self.seen.get(address)
        if kept is not None and kept[0]._version == kept[2] and _same_storage(kept[0], t):
            return _Offloaded(kept[1], t)       # another view of a storage already sent (unwritten since):
            # the input both projections keep, ...
        owner = self.owner
        device_bytes = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        host = torch.empty(device_bytes.shape, dtype=torch.uint8, pin_memory=owner.stream is not None)
        sent = None
        if owner.stream is not None:
            owner.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(owner.stream):
                host.copy_(device_bytes, non_blocking=True)
                sent = torch.cuda.Event()
                sent.record(owner.stream)
            device_bytes.record_stream(owner.stream)
        else:
            host.copy_(device_bytes)
        owner.bytes_offloaded += host.numel()
        storage = _HostStorage(host, sent)
        self.storages.append(weakref.ref(storage))
        self.seen[address] = (t, storage, t._version)   # t kept until the layer's forward ends: no reuse
        return _Offloaded(storage, t)

    def unpack(self, item):
        if not isinstance(item, _Offloaded):
            return item
        if self.previous is not None and not self.previous.prefetched:
            self.previous.prefetch()
        storage = item.storage
        if storage.back is None:
            self._copy_back(storage)
        if storage.ready is not None:
            current = torch.cuda.current_stream(self.owner.device)
            current.wait_event(storage.ready)
            storage.back.record_stream(current)
            storage.ready = None
        return torch.empty(0, dtype=item.dtype, device=storage.back.device).set_(
            storage.back.untyped_storage(), item.offset, item.shape, item.stride)

    def prefetch(self) -> None:
        """Start copying every offloaded storage of this layer still needed back to the device."""
        self.prefetched = True
        for ref in self.storages:
            storage = ref()
            if storage is not None and storage.back is None:
                self._copy_back(storage)

    def _copy_back(self, storage: _HostStorage) -> None:
        owner = self.owner
        if owner.stream is None:                 # on a CPU the host copy is the tensor
            storage.back = storage.host
        else:
            owner.stream.wait_event(storage.sent)
            with torch.cuda.stream(owner.stream):
                storage.back = storage.host.to(owner.device, non_blocking=True)
                storage.ready = torch.cuda.Event()
                storage.ready.record(owner.stream)
        owner.bytes_reloaded += storage.host.numel()


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


def take_offloaded_bytes(chunks) -> int:
    """Bytes this rank's chunks sent to the host since the last call (the counters start over)."""
    total = 0
    for chunk in chunks:
        offload = getattr(chunk, "activation_offload", None)
        if offload is not None:
            total += offload.bytes_offloaded
            offload.bytes_offloaded = offload.bytes_reloaded = 0
    return total
