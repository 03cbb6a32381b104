"""ZeRO-Offload and ZeRO-Infinity: the optimizer's shard, and stage 3's parameter shards, kept in host
memory or in swap files on a fast local drive instead of on the device.

Flags (``ZeroConfig``): ``--offload-optimizer {none,cpu,nvme}`` (ZeRO 1-3), ``--offload-params
{none,cpu,nvme}`` (ZeRO-3), ``--nvme-path DIR``, ``--offload-pin-memory``, ``--offload-sub-group-size S``.

Who holds what, per rank (Ψ parameters of the rank's stage, N = dp, e bytes per parameter element, g per
gradient element; fp32 runs have e = g = 4 and, without offload, no separate masters)::

                                  device                      host                              NVMe
    ZeRO-1 + optimizer cpu        eΨ params + gΨ grads        16Ψ/N: fp32 masters, Adam m, v,     -
                                                              the fp32 copy of the gradients
    ZeRO-2 + optimizer cpu        eΨ + gΨ/N                   16Ψ/N                               -
    ZeRO-3 + optimizer cpu        eΨ/N + gΨ/N                 16Ψ/N                               -
    optimizer nvme                as with cpu                 4Ψ/N gradients + 3 sub-group        12Ψ/N
                                                              buffers (3 x 12 x S bytes)
    ZeRO-3 + params cpu           minus eΨ/N                  plus eΨ/N                           -
    ZeRO-3 + params nvme          minus eΨ/N                  shards being read                   eΨ/N

(plus, on the device, the units being gathered under ZeRO-3: 1/N of each as a staging copy when the
shards are offloaded). DeepSpeed keeps the same fp32 gradient copy on the host.

One step with ``--offload-optimizer``:

1. Backward. As each bucket's reduced gradient shard lands (stages 2 and 3: when its reduce-scatter retires,
   during the backward; stage 1: when ``finish_grad_sync`` waits for it) the rank's part is copied into
   the host's flat fp32 gradient buffer: on CUDA from a side stream into pinned memory, overlapping the
   backward; on a CPU the same calls, where the copy is a plain memory copy.
2. Step. The overflow check, global norm and clipping run over the host gradients. Then AdamW runs over
   the flat shard, one sub-group (``offload_sub_group_size`` elements) at a time, as torch's fused CPU
   kernel; each updated sub-group of masters is cast to the parameter dtype and copied to the device
   (side stream) while the next one is updated.
3. NVMe (ZeRO-Infinity). Masters and moments live in the rank's swap file, not in memory. Sub-group i+1
   is read by a read-ahead thread and sub-group i-1 written by a write-behind thread while sub-group i is
   updated, through three buffers (DeepSpeed's swap-tensor design).

Parity: the host runs the same fp32 arithmetic on the same values, so an fp32 run is bitwise the same with
and without offload. Sub-groups cut the flat shard at multiples of 64 elements from every range's start,
and torch's fused AdamW works in 16-element blocks from the start of the tensor it is given, so cutting
changes no bit (``tests/test_offload.py`` checks both).

Parameter shards (``--offload-params``): ``offload_params.py``. Swap files: ``swap.py``.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megazero.config import FLAG
from megazero.parallel.zero.adamw import adamw_update, clip_ranges
from megazero.parallel.zero.swap import SwapDir, io_thread, round_up

ALIGN = 64                   # elements: sub-groups are cut at multiples of this from every range's start
BUFFERS = 3                  # NVMe sub-group buffers: read-ahead (i+1), update (i), write-behind (i-1)
MAX_SUB_GROUP = 4_000_000    # elements: the default sub-group's upper bound
SUB_GROUPS = 32              # the default cuts a rank's shard into this many sub-groups (fewer when small)


def sub_group_elements(requested: int | None, total: int) -> int:
    """Elements per sub-group for a flat shard of ``total`` elements: ``requested`` (--offload-sub-group-size)
    rounded up to a multiple of ALIGN, or by default 1/SUB_GROUPS of the shard, at most MAX_SUB_GROUP. The
    host buffers of nvme offloading are three sub-groups of 12 bytes per element, so the default keeps them
    under a tenth of the 12 bytes per element they take out of memory."""
    if requested is None:
        requested = min(MAX_SUB_GROUP, -(-total // SUB_GROUPS))
    return round_up(max(requested, 1), ALIGN)


@dataclass
class OffloadStats:
    """Host-side wall time and bytes of the offloaded work since the last ``reset`` (what the benchmark
    reports). On CUDA the copies are asynchronous and their time is that of issuing them."""

    to_host_s: float = 0.0       # gradients, device -> host
    to_device_s: float = 0.0     # parameters, host -> device
    update_s: float = 0.0        # AdamW on the host (and the casts to the parameter dtype)
    io_wait_s: float = 0.0       # the step waiting for swap-file reads and writes
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, type(getattr(self, name))())

    def add(self, other: OffloadStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


# ------------------------------------------------------------------------------------------ copies
class Mover:
    """Copies between the device and host memory, the same calls on every device.

    On CUDA: host buffers are page-locked (``pin``), and copies run on a side stream, ordered after the
    work already queued on the compute stream, so they overlap the computation; ``wait_host`` makes their
    results readable on the host and ``join`` makes the compute stream wait for them. On a CPU the
    "device" is host memory too: the copies are plain memory copies and the waits do nothing.
    """

    def __init__(self, device: torch.device, pin: bool = True, stats: OffloadStats | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = bool(pin) and self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = stats if stats is not None else OffloadStats()

    def host_empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pin)

    def host_zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_empty(n, dtype).zero_()

    @contextlib.contextmanager
    def side_stream(self):
        """Work issued inside runs on the side stream, after what the compute stream has queued."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host) <- ``src`` (device), asynchronously on CUDA: ``wait_host`` before reading dst."""
        t0 = time.perf_counter()
        with self.side_stream():
            dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            src.record_stream(self.stream)
        self.stats.to_host_s += time.perf_counter() - t0
        self.stats.bytes_to_host += src.numel() * src.element_size()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (device) <- ``src`` (host), on the side stream: ``join`` before the compute stream reads
        dst, and keep src unchanged until an ``event()`` recorded after it has completed."""
        t0 = time.perf_counter()
        with self.side_stream():
            dst.copy_(src, non_blocking=self.cuda)
        self.stats.to_device_s += time.perf_counter() - t0
        self.stats.bytes_to_device += src.numel() * src.element_size()

    def event(self):
        """A marker after the side stream's work so far (None on a CPU, where copies are done at once)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait_host(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def wait_event(event) -> None:
    if event is not None:
        event.synchronize()


# ---------------------------------------------------------------------------- optimizer state
class DelayedUpdate:
    """ZeRO-Offload's one-step delayed parameter update (DPU, Ren et al. 2021, ``--offload-delayed-update``):
    the host's AdamW step over step t's gradients runs in a background thread while the device runs step
    t + 1's forward and backward, which therefore use the parameters from before that update. At the end
    of step t + 1 the update is waited for and its masters become the parameters, and step t + 1's update
    starts. So the update of step t's gradients reaches the parameters one step late::

        step 1:  forward/backward on P0            -> g1   launch update(g1)
        step 2:  forward/backward on P0            -> g2   wait: P1 = update(g1); launch update(g2)
        step 3:  forward/backward on P1            -> g3   wait: P2 = update(g2); launch update(g3)

    The gradients are copied into a buffer of their own before the thread starts (the next step's
    backward writes the gradient buffers meanwhile); norm, clipping and the overflow check run on them
    before, in the step as without delay, and each update uses its own step's learning rate. Every rank
    has an update pending or none at the same time (the step's decisions are global).
    :meth:`settle` (before a checkpoint, a gathered model, the end) applies a pending update at once, so a
    run resumed from a checkpoint continues exactly as the run that wrote it."""

    def __init__(self, states: "OffloadedOptimizerState"):
        self.states = states
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="delayed-update")
        self.pending: Future | None = None
        self.grads: list[torch.Tensor] | None = None

    def launch(self, grads: list[torch.Tensor], **update) -> None:
        """Start the update of ``grads`` (the step's clipped fp32 gradients; copied first). ``update``:
        :meth:`OffloadedOptimizerState.update`'s keywords but ``write``."""
        assert self.pending is None, "settle() the pending update first"
        if self.grads is None:
            self.grads = [torch.empty_like(g) for g in grads]
        for mine, g in zip(self.grads, grads):
            mine.copy_(g)
        self.pending = self.pool.submit(self.states.update, self.grads, write=None, **update)

    def settle(self) -> bool:
        """Wait for the pending update (re-raising its error); whether there was one."""
        if self.pending is None:
            return False
        pending, self.pending = self.pending, None
        pending.result()
        return True

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class OffloadedOptimizerState:
    """The optimizer's fp32 state of this rank's owned ranges, off the device: a flat host gradient buffer,
    and masters and Adam moments in host memory (this class) or in a swap file (:class:`SwappedOptimizerState`).

    The owned ranges (one per bucket, sizes multiples of 64) are laid out one after another in a flat
    index space; sub-group i covers flat elements [i * S, (i + 1) * S), S = ``sub_group_size`` rounded up to
    64. The optimizer (``megazero.parallel.zero.optimizer``) drives it: ``copy_grad`` as gradients land,
    ``main_grads`` / ``update`` in the step, ``views`` for checkpoints.
    """

    location = "host"

    def __init__(self, sizes: list[int], device: torch.device, param_dtype: torch.dtype, sub_group_size: int | None,
                 pin: bool = True, swap: SwapDir | None = None, device_grads=None):
        self.sizes = list(sizes)
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.stats = OffloadStats()
        self.mover = Mover(device, pin, self.stats)
        self.param_dtype = param_dtype
        step = sub_group_elements(sub_group_size, self.total)
        self.subgroups = [(s, min(s + step, self.total)) for s in range(0, self.total, step)]
        # Where the device is the host (a CPU run) and the reduced gradients are fp32, the host copy would
        # only duplicate them: ``device_grads()`` gives the device's views instead and nothing is copied.
        self.device_grads = device_grads
        self.grads = None if device_grads is not None else self.mover.host_zeros(self.total, torch.float32)
        cast = param_dtype != torch.float32             # the masters are cast on the host before the copy
        self._staging = [self.mover.host_empty(min(step, self.total), param_dtype) if cast else None
                         for _ in range(2)]
        self._staging_done = [None, None]
        self._allocate(swap)

    def _allocate(self, swap: SwapDir | None) -> None:
        self.master = self.mover.host_zeros(self.total, torch.float32)
        self.exp_avg = self.mover.host_zeros(self.total, torch.float32)
        self.exp_avg_sq = self.mover.host_zeros(self.total, torch.float32)

    # -------------------------------------------------------------- per range
    def views(self, k: int) -> dict[str, torch.Tensor]:
        """Range k's ``master``, ``exp_avg``, ``exp_avg_sq`` (host tensors; read and written in place)."""
        a, b = self.offsets[k], self.offsets[k] + self.sizes[k]
        return {"master": self.master[a:b], "exp_avg": self.exp_avg[a:b], "exp_avg_sq": self.exp_avg_sq[a:b]}

    def host_views(self, k: int) -> tuple[torch.Tensor | None, ...]:
        """(master, exp_avg, exp_avg_sq) of range k where they stay in memory, else Nones."""
        v = self.views(k)
        return v["master"], v["exp_avg"], v["exp_avg_sq"]

    def set_masters(self, k: int, values: torch.Tensor) -> None:
        """Range k's masters <- ``values`` (the parameters, any device and dtype)."""
        self.views(k)["master"].copy_(values)

    def copy_grad(self, k: int, a: int, b: int, src: torch.Tensor) -> None:
        """Range k's gradient elements [a, b) <- ``src`` (the reduced gradient on the device)."""
        if self.grads is None:
            return
        off = self.offsets[k]
        self.mover.to_host(self.grads[off + a:off + b], src)

    def main_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient of every range, on the host, once every copy has landed."""
        if self.grads is None:
            return self.device_grads()
        self.mover.wait_host()
        return [self.grads[off:off + n] for off, n in zip(self.offsets, self.sizes)]

    # ------------------------------------------------------------------ step
    def _acquire(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, e = self.subgroups[i]
        return self.master[s:e], self.exp_avg[s:e], self.exp_avg_sq[s:e]

    def _release(self, i: int, done) -> None:
        pass

    def _begin(self) -> None:
        pass

    def _end(self) -> None:
        pass

    def update(self, grads: list[torch.Tensor], decay_ranges: list[list[tuple[int, int]]], *, write, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled_lr: float | None = None, decoupled_ranges: list[list[tuple[int, int]]] | None = None) -> None:
        """One AdamW step over the flat shard, sub-group by sub-group. ``grads``: what ``main_grads`` gave
        (views of the host buffer, unscaled and clipped in place). ``decay_ranges[k]``: range k's elements
        with weight decay; ``decoupled_ranges[k]`` those at ``decoupled_lr``. ``write(k, a, b, values)``
        stores range k's new parameter values [a, b) where the model keeps them; it is called inside the mover's
        side stream, and ``values`` stays untouched until that copy has completed. ``write=None`` (the
        delayed update, :class:`DelayedUpdate`): only the masters and moments change."""
        self._begin()
        for i, (s, e) in enumerate(self.subgroups):
            master, exp_avg, exp_avg_sq = self._acquire(i)
            t0 = time.perf_counter()
            segments = list(self._segments(s, e))       # the sub-group's part of each range it crosses
            cut = [(self.offsets[k] + a - s, self.offsets[k] + b - s) for k, a, b in segments]
            decay = [clip_ranges(decay_ranges[k], a, b) for k, a, b in segments]
            own = [clip_ranges(decoupled_ranges[k], a, b) for k, a, b in segments] if decoupled_ranges else None
            adamw_update([master[x:y] for x, y in cut], [grads[k][a:b] for k, a, b in segments],
                         [exp_avg[x:y] for x, y in cut], [exp_avg_sq[x:y] for x, y in cut], step=step, lr=lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decay_ranges=decay,
                         decoupled_lr=decoupled_lr, decoupled_ranges=own)
            if write is None:                            # a delayed update: the caller publishes the masters
                self.stats.update_s += time.perf_counter() - t0
                self._release(i, None)
                continue
            values = master
            staging = self._staging[i % 2]
            if staging is not None:
                wait_event(self._staging_done[i % 2])
                values = staging[:e - s]
                values.copy_(master)
            self.stats.update_s += time.perf_counter() - t0
            self._store(write, s, e, values)
            done = self.mover.event()
            if staging is not None:
                self._staging_done[i % 2] = done
            self._release(i, done)
        self._end()
        self.mover.join()

    def _store(self, write, s: int, e: int, values: torch.Tensor) -> None:
        """``write`` the new parameter values of flat elements [s, e) (``values``), on the side stream."""
        t0 = time.perf_counter()
        with self.mover.side_stream():
            for k, a, b in self._segments(s, e):
                write(k, a, b, values[self.offsets[k] + a - s:self.offsets[k] + b - s])
        self.stats.to_device_s += time.perf_counter() - t0
        self.stats.bytes_to_device += values.numel() * values.element_size()

    def write_params(self, write) -> None:
        """Store every range's masters as its parameters (after the state was loaded)."""
        for k, n in enumerate(self.sizes):
            with self.mover.side_stream():
                write(k, 0, n, self.views(k)["master"])
        self.mover.wait_host()
        self.mover.join()

    def _segments(self, s: int, e: int):
        """(range k, a, b): the part [a, b) of range k inside flat elements [s, e)."""
        for k, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(s, off), min(e, off + n)
            if a < b:
                yield k, a - off, b - off

    # ------------------------------------------------------------ accounting
    def offloaded_bytes(self) -> dict[str, int]:
        staging = sum(t.numel() * t.element_size() for t in self._staging if t is not None)
        return {"host_grads": 0 if self.grads is None else 4 * self.total, "host_master_weights": 4 * self.total,
                "host_optimizer_state": 8 * self.total, "host_buffers": staging}

    def close(self) -> None:
        pass


class SwappedOptimizerState(OffloadedOptimizerState):
    """ZeRO-Infinity: masters and moments in this rank's swap file (``optimizer.swp``), three regions of
    fp32 elements in the flat layout: [masters][exp_avg][exp_avg_sq]. The step streams sub-groups
    through ``BUFFERS`` buffers, reading ahead and writing behind on two I/O threads."""

    location = "nvme"

    def _allocate(self, swap: SwapDir | None) -> None:
        if swap is None:
            raise ValueError(f"offloading the optimizer to nvme needs a swap directory ({FLAG.nvme_path})")
        self.file = swap.file("optimizer.swp")
        self.region = [self.file.reserve(4 * self.total) for _ in range(3)]   # zero-filled: moments start at 0
        width = max((e - s for s, e in self.subgroups), default=0)
        self._nbuf = max(1, min(BUFFERS, len(self.subgroups)))     # fewer sub-groups need fewer buffers
        self._buffers = [self.mover.host_empty(3 * width, torch.float32) for _ in range(self._nbuf)]
        self._reader, self._writer = io_thread("swap-read"), io_thread("swap-write")
        self._reads: dict[int, Future] = {}
        self._writes: dict[int, Future] = {}
        self.master = self.exp_avg = self.exp_avg_sq = None

    def _parts(self, i: int) -> list[torch.Tensor]:
        s, e = self.subgroups[i]
        buf = self._buffers[i % self._nbuf]
        n = e - s
        return [buf[j * n:(j + 1) * n] for j in range(3)]

    def _read(self, i: int, previous: Future | None, done) -> None:
        if previous is not None:
            previous.result()                   # the buffer's last write-behind has finished
        wait_event(done)                             # and the device copy that read it
        s, _ = self.subgroups[i]
        for region, part in zip(self.region, self._parts(i)):
            self.file.read(region + 4 * s, part)
            self.stats.bytes_read += 4 * part.numel()

    def _write(self, i: int, done) -> None:
        wait_event(done)
        s, _ = self.subgroups[i]
        for region, part in zip(self.region, self._parts(i)):
            self.file.write(region + 4 * s, part)
            self.stats.bytes_written += 4 * part.numel()

    def _prefetch(self, i: int) -> None:
        if i < len(self.subgroups) and i not in self._reads:
            previous = self._writes.pop(i - self._nbuf, None)      # the buffer's last user
            self._reads[i] = self._reader.submit(self._read, i, previous, self._events.pop(i - self._nbuf, None))

    def _begin(self) -> None:
        self._events: dict[int, object] = {}
        self._prefetch(0)

    def _acquire(self, i: int):
        self._prefetch(i + 1)                   # read-ahead: overlaps this sub-group's update
        t0 = time.perf_counter()
        self._reads.pop(i).result()
        self.stats.io_wait_s += time.perf_counter() - t0
        return tuple(self._parts(i))

    def _release(self, i: int, done) -> None:
        self._writes[i] = self._writer.submit(self._write, i, done)   # write-behind
        self._events[i] = done

    def _end(self) -> None:
        t0 = time.perf_counter()
        for f in list(self._writes.values()) + list(self._reads.values()):
            f.result()
        self._writes.clear()
        self._reads.clear()
        self.stats.io_wait_s += time.perf_counter() - t0

    def views(self, k: int) -> dict[str, torch.Tensor]:
        """Range k's state as views of the swap file itself (a memory map; see ``SwapFile.mapped``)."""
        off, n = self.offsets[k], self.sizes[k]
        return {key: self.file.mapped(region + 4 * off, n, torch.float32)
                for key, region in zip(("master", "exp_avg", "exp_avg_sq"), self.region)}

    def host_views(self, k: int):
        return None, None, None

    def set_masters(self, k: int, values: torch.Tensor) -> None:
        """Range k's masters <- ``values``, written through the file a sub-group's width at a time (no map:
        the process never holds more than that)."""
        off, n = self.offsets[k], self.sizes[k]
        width = max((e - s for s, e in self.subgroups), default=n) or n
        for a in range(0, n, width):
            part = torch.empty(min(width, n - a), dtype=torch.float32)
            part.copy_(values[a:a + part.numel()])
            self.file.write(self.region[0] + 4 * (off + a), part)

    def offloaded_bytes(self) -> dict[str, int]:
        buffers = sum(t.numel() * t.element_size() for t in self._buffers)
        buffers += sum(t.numel() * t.element_size() for t in self._staging if t is not None)
        return {"host_grads": 0 if self.grads is None else 4 * self.total, "host_buffers": buffers,
                "nvme_master_weights": 4 * self.total, "nvme_optimizer_state": 8 * self.total}

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)


def build_optimizer_state(where: str, sizes: list[int], device, param_dtype, sub_group_size: int | None, pin: bool,
                          swap: SwapDir | None, device_grads=None) -> OffloadedOptimizerState:
    """``--offload-optimizer cpu`` or ``nvme``. ``device_grads``: a callable giving the fp32 reduced
    gradient of every range where those already sit in host memory (a CPU run), else None."""
    cls = {"cpu": OffloadedOptimizerState, "nvme": SwappedOptimizerState}[where]
    return cls(sizes, device, param_dtype, sub_group_size, pin, swap, device_grads)

