"""Where ZeRO-3's parameter shards live: the shard stores of stage 3's parameters (:mod:`.param_sync`).

    store          --offload-params   rank r's shard of every bucket       gathering a unit
    DeviceShards   none (default)     ``bucket.shard``, device memory       all-gathers from it
    HostShards     cpu                ``bucket.shard``, pinned host memory  copies it to a device staging buffer
    SwappedShards  nvme               a page-aligned region of params.swp  reads it (an I/O thread), then as cpu

One store serves every bucket group of an engine (dense parameters and experts share the swap file).
With nvme the shard is read by an I/O thread one unit ahead of the gathers the prefetch already launches,
and the optimizer's writes of the new values go through the same thread (so a read never overtakes a
write). Stages 0-2 hold no shards: the engine builds the store from the config all the same, and only
stage 3's parameters use it.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future

import torch

from megazero.config import FLAG
from megazero.parallel.zero.offload import Mover, OffloadStats, wait_event
from megazero.parallel.zero.swap import SwapDir, io_thread


class DeviceShards:
    """The parameter shards without offloading: ``bucket.shard``, on the device (the default store)."""

    offloaded = False

    def allocate(self, bucket, n: int, dtype: torch.dtype, device) -> None:
        bucket.shard = torch.zeros(n, dtype=dtype, device=device)

    @contextlib.contextmanager
    def filling(self, bucket):
        yield bucket.shard

    def view(self, bucket) -> torch.Tensor:
        return bucket.shard

    def source(self, bucket) -> torch.Tensor:
        return bucket.shard

    def prefetch(self, bucket) -> None:
        pass

    def write(self, bucket, lo: int, hi: int, values: torch.Tensor) -> None:
        bucket.shard[lo:hi].copy_(values, non_blocking=True)

    def flush(self) -> None:
        pass

    def offloaded_bytes(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class HostShards:
    """ZeRO-3's parameter shards in host memory (``--offload-params cpu``): ``bucket.shard`` is a host
    tensor; gathering copies it into a device staging buffer first."""

    offloaded = True

    def __init__(self, device: torch.device, pin: bool = True, swap: SwapDir | None = None):
        self.stats = OffloadStats()
        self.mover = Mover(device, pin, self.stats)
        self.device = torch.device(device)
        self._bytes = 0
        self._copied = None                    # CUDA: the last staging copy, which reads a host shard

    def allocate(self, bucket, n: int, dtype: torch.dtype, device=None) -> None:
        bucket.shard = self.mover.host_zeros(n, dtype)
        self._bytes += n * bucket.shard.element_size()

    @contextlib.contextmanager
    def filling(self, bucket):
        """A writable tensor of the whole shard; what it holds on exit is stored."""
        yield bucket.shard

    def view(self, bucket) -> torch.Tensor:
        return bucket.shard

    def prefetch(self, bucket) -> None:
        pass

    def source(self, bucket) -> torch.Tensor:
        """The shard on the device, to all-gather from (a staging copy, freed by the caller)."""
        return self._staged(self.view(bucket))

    def _staged(self, host: torch.Tensor) -> torch.Tensor:
        staging = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
        t0 = time.perf_counter()
        staging.copy_(host, non_blocking=self.mover.cuda)     # on the compute stream, before the all-gather
        if self.mover.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.stats.to_device_s += time.perf_counter() - t0
        self.stats.bytes_to_device += host.numel() * host.element_size()
        return staging

    def write(self, bucket, lo: int, hi: int, values: torch.Tensor) -> None:
        wait_event(self._copied)                     # no staging copy still reads the old values
        bucket.shard[lo:hi].copy_(values)

    def flush(self) -> None:
        pass

    def offloaded_bytes(self) -> dict[str, int]:
        return {"host_params": self._bytes}

    def close(self) -> None:
        pass


class SwappedShards(HostShards):
    """ZeRO-3's parameter shards in this rank's swap file (``--offload-params nvme``): a page-aligned
    region per bucket of ``params.swp``. Reads (read-ahead for gathers) and writes (new values from the
    optimizer) go through one I/O thread in order, so a read never sees a value older than a write
    issued before it."""

    def __init__(self, device: torch.device, pin: bool = True, swap: SwapDir | None = None):
        super().__init__(device, pin, swap)
        if swap is None:
            raise ValueError(f"offloading the parameters to nvme needs a swap directory ({FLAG.nvme_path})")
        self.file = swap.file("params.swp")
        self._io = io_thread("param-io")
        self._where: dict[int, tuple[int, int, torch.dtype]] = {}
        self._reads: dict[int, Future] = {}
        self._writes: list[Future] = []

    def allocate(self, bucket, n: int, dtype: torch.dtype, device=None) -> None:
        size = torch.empty(0, dtype=dtype).element_size()
        self._where[id(bucket)] = (self.file.reserve(n * size), n, dtype)
        bucket.shard = None
        self._bytes += n * size

    @contextlib.contextmanager
    def filling(self, bucket):
        _, n, dtype = self._where[id(bucket)]
        tmp = torch.zeros(n, dtype=dtype)
        yield tmp
        self.write(bucket, 0, n, tmp)

    def view(self, bucket) -> torch.Tensor:
        """The shard as a view of the file (memory map): pending writes land first."""
        self.flush()
        self._reads.pop(id(bucket), None)
        offset, n, dtype = self._where[id(bucket)]
        return self.file.mapped(offset, n, dtype)

    def _read(self, bucket) -> torch.Tensor:
        offset, n, dtype = self._where[id(bucket)]
        out = self.mover.host_empty(n, dtype)
        self.file.read(offset, out)
        self.stats.bytes_read += n * out.element_size()
        return out

    def prefetch(self, bucket) -> None:
        if id(bucket) not in self._reads:
            self._reads[id(bucket)] = self._io.submit(self._read, bucket)

    def source(self, bucket) -> torch.Tensor:
        self.prefetch(bucket)
        t0 = time.perf_counter()
        host = self._reads.pop(id(bucket)).result()
        self.stats.io_wait_s += time.perf_counter() - t0
        return self._staged(host)

    def _write(self, offset: int, host: torch.Tensor) -> None:
        self.file.write(offset, host)
        self.stats.bytes_written += host.numel() * host.element_size()

    def write(self, bucket, lo: int, hi: int, values: torch.Tensor) -> None:
        offset, _, dtype = self._where[id(bucket)]
        host = torch.empty(hi - lo, dtype=dtype)
        host.copy_(values)                      # an owned copy: the caller may reuse values at once
        self._reads.pop(id(bucket), None)       # a read issued before this write is stale
        self._writes.append(self._io.submit(self._write, offset + lo * host.element_size(), host))

    def flush(self) -> None:
        t0 = time.perf_counter()
        for f in self._writes:
            f.result()
        self._writes.clear()
        self.stats.io_wait_s += time.perf_counter() - t0

    def offloaded_bytes(self) -> dict[str, int]:
        return {"nvme_params": self._bytes}

    def close(self) -> None:
        self.flush()
        self._io.shutdown(wait=True)


def build_param_shards(where: str, device, pin: bool, swap: SwapDir | None):
    """The shard store ``--offload-params`` asks for: ``none``, ``cpu`` or ``nvme``."""
    if where == "none":
        return DeviceShards()
    return {"cpu": HostShards, "nvme": SwappedShards}[where](device, pin, swap)
