"""Measuring memory honestly on a CPU, where the allocator, not the tensors, decides the resident size.

glibc keeps freed memory in its heap, so a process's resident set mostly measures the allocator's
history: a ZeRO-3 run that holds 180 MiB of tensors can show 1.5 GiB resident. Two remedies:

* :func:`return_freed_memory` asks glibc (``mallopt``) to serve allocations of 1 MiB and more with
  their own mappings, returned to the system when freed, so resident memory follows the tensors
  alive (plus the interpreter and libraries). It is not free: every large allocation is then a fresh
  mapping whose pages fault in on first touch (a ZeRO-3 step at 69M parameters, dp 4: 2.3 s against
  1.4 s), so ``pretrain_gpt.py`` calls it only with ``--return-freed-memory``. By default it calls
  :func:`reuse_freed_memory` instead: glibc keeps freed memory for the next step's buffers, whose
  pages then fault in once per run, not once per step (glibc's own default moves its threshold as
  it goes and still maps, and trims, tens of MiB afresh every step: about 34,600 page faults, 135 MiB,
  per rank and step at that shape, against none), and the ``peak mem`` logged is the resident set,
  above the live tensors (:func:`describe_cpu_memory` says which at start).
* :class:`LiveTensorBytes` counts the bytes of tensors alive, from the allocation events of
  torch's profiler: exact and independent of the allocator, but slow enough to be for tests and
  benchmarks only. A block counts no free of a tensor allocated before it started: measure from
  before what you care about is created, chain blocks with ``after=``, or start a step early and
  :meth:`LiveTensorBytes.mark`.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys

import torch

from megazero.config import FLAG

M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1


# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): allocations below it come from the heap.
REUSE_MMAP_THRESHOLD = 32 << 20


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds (fixed from then on). False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                           trim_threshold))
    except (OSError, AttributeError):
        return False


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Make glibc map allocations of at least ``threshold`` bytes separately and trim its heap, so
    freed tensors leave the resident set. Returns False where there is no glibc (macOS, musl)."""
    return _mallopt(threshold, threshold)


def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse: allocations below :data:`REUSE_MMAP_THRESHOLD` come
    from its heap and the heap is trimmed only above twice that, so a training step's buffers reuse
    the last step's pages instead of faulting in fresh ones (what CUDA's caching allocator does for
    GPU runs). Resident memory then stays near the run's peak. False where there is no glibc."""
    return _mallopt(REUSE_MMAP_THRESHOLD, 2 * REUSE_MMAP_THRESHOLD)


def describe_cpu_memory(returning: bool, device: torch.device) -> str:
    """The start-of-run line saying what the ``peak mem`` figure of the log lines measures."""
    if device.type == "cuda":
        return (" GPU memory: peak mem is the peak of allocated CUDA memory (live tensors)"
                + (f"; {FLAG.return_freed_memory} concerns CPU runs only and does nothing here" if returning else ""))
    if returning:
        return (f" CPU memory: freed memory returned to the system at once ({FLAG.return_freed_memory}): peak mem "
                "follows the live tensors (plus the interpreter), at a cost in step time")
    return (" CPU memory: freed memory kept by glibc for reuse (fastest: allocations under 32 MiB reuse the heap): "
            f"peak mem is the resident set, above the live tensors; {FLAG.return_freed_memory} makes it follow them, "
            "at a cost in step time")


class LiveTensorBytes:
    """Peak bytes of CPU tensors alive inside the ``with`` block, from the profiler's allocation events.

        with LiveTensorBytes() as build:           # what was alive before counts as 0 ...
            chunks, engine = build_model()
        with LiveTensorBytes(after=build) as step:   # ... or, chained, as what ``build`` left alive
            train_step(...)
        build.peak, step.peak, step.end

    A block counts the allocations it sees and the frees of the blocks it saw allocated; a free of a
    tensor allocated before the block is not counted (it stays counted in ``alive``): measure from
    before what you care about is created (``gc.collect()`` first). ``after=`` chains blocks that
    follow each other: the next block starts from the previous one's ``end`` and also counts the frees
    of what the previous one left alive (a step freeing the forward's activations, say). ``alive=``
    sets the starting bytes instead (with ``after=``, a corrected figure). Torch's profiler itself
    reports a free's size for any block allocated while any profiler ran, even one freed since and its
    address reused outside a profiler; those frees would subtract bytes nothing here allocated, by a
    different amount each run, so the frees are matched by address to this block's own allocations.

    For the peak of one training step, whose tensors from the step before (gradients, say) die
    inside it, open the block a step early and call :meth:`mark` where the step begins with the bytes
    alive there (counted exactly at a quiescent point, e.g. by walking the reachable tensors):
    counting starts over at the mark, and the frees of what the step before allocated are seen::

        with LiveTensorBytes() as probe:
            train_step(...)          # allocates what the next step frees
            probe.mark(alive_now)
            train_step(...)
        probe.peak, probe.end        # the second step's

    The profiler sees the allocations and frees of the thread that runs the block:
    a tensor whose last reference dies in a collective's worker thread (gloo, with tp > 1) stays
    counted, so keep blocks short (one step) and read the figures as upper bounds there.
    """

    _MARK = "megazero.LiveTensorBytes.mark"

    def __init__(self, alive: int | None = None, after: "LiveTensorBytes | None" = None) -> None:
        if alive is None:
            alive = after.end if after is not None else 0
        self.alive = alive
        self.peak = self.end = alive
        self._prof = None
        self._marked: int | None = None
        self._held: dict[int, int] = dict(after._held) if after is not None else {}   # address -> bytes

    def mark(self, alive: int) -> None:
        """Start counting over here, from ``alive`` bytes (see the class docstring)."""
        self._marked = alive
        with torch.profiler.record_function(self._MARK):
            pass

    def __enter__(self) -> "LiveTensorBytes":
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        allocations, marks = _allocations_and_marks(self._prof, self._MARK)
        before: list = []
        start = self.alive
        if self._marked is not None:
            if not marks:
                raise RuntimeError("LiveTensorBytes.mark() was called but the profiler recorded no mark")
            cut = max(marks)
            before = [a for a in allocations if a[0] < cut]
            allocations = [a for a in allocations if a[0] >= cut]
            start = self._marked
        for _, address, nbytes in before:                   # before the mark: only which blocks are held
            self._change(address, nbytes)
        live = peak = start
        for _, address, nbytes in allocations:
            live += self._change(address, nbytes)
            peak = max(peak, live)
        self.peak, self.end = peak, live

    def _change(self, address: int, nbytes: int) -> int:
        """The live bytes' change for one allocation event: an allocation adds its size, a free takes
        off the size of the block this chain saw allocated at that address, or nothing."""
        if nbytes > 0:
            self._held[address] = nbytes
            return nbytes
        return -self._held.pop(address, 0)


def _allocations_and_marks(prof, mark_name: str) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The CPU allocation events a finished profiler recorded, as (time, address, bytes; negative for a
    free) in time order, and the times of the ``record_function`` blocks named ``mark_name``."""
    from torch._C._profiler import _EventType

    allocations, marks = [], []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:                                            # pre-order: a thread's events as recorded
        node = stack.pop()
        stack.extend(reversed(node.children))
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif event_name(node) == mark_name:
            marks.append(node.start_time_ns)
    allocations.sort(key=lambda a: a[0])                    # stable: ties keep the recorded order
    return allocations, marks


def reachable_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor Python can reach, with the gradients of leaf
    tensors (autograd keeps ``.grad`` in C++: reading it makes it reachable) and the local shards of
    DTensors. Exact at a quiescent point (no autograd graph, no collective in flight), where
    :class:`LiveTensorBytes` may still count a buffer a collective's thread freed."""
    import gc

    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        for t in (obj, obj.grad if obj.is_leaf and obj.requires_grad else None):
            if t is not None and hasattr(t, "to_local"):
                t = t.to_local()
            if t is None or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):      # a wrapper without storage of its own
                continue
    return sum(storages.values())


class LastStepLiveBytes:
    """``--measure-live-bytes``: the peak bytes of live tensors during a run's last training step, the
    same way the benchmarks measure their peers (so a run and a plain script compare like for like).

    Wraps each step (:meth:`step`, as :class:`megazero.profiling.StepProfiler` does) and does nothing
    before the step ahead of the last one. On a CPU a :class:`LiveTensorBytes` opens there and counts over
    at the start of the last step from the bytes alive then (:func:`reachable_tensor_bytes`): the last
    step's frees of what the step before allocated (its gradients) are seen. Both steps run under the
    profiler, slower: time a run's other steps. A run that starts at its last step (resumed there)
    counts from its start, an upper bound. On a GPU: the peak of allocated CUDA memory over the last step.
    ``peak`` is None until the last step has run.
    """

    def __init__(self, enabled: bool, last_iteration: int, device: torch.device) -> None:
        self.enabled, self.last, self.device = enabled, last_iteration, device
        self.peak: int | None = None
        self._probe: LiveTensorBytes | None = None

    @contextlib.contextmanager
    def step(self, iteration: int):
        """A context for the step that takes the run from ``iteration`` to ``iteration + 1``."""
        last = iteration + 1 == self.last
        if not self.enabled or iteration + 2 < self.last:
            yield
            return
        if self.device.type == "cuda":
            if last:
                torch.cuda.reset_peak_memory_stats(self.device)
            yield
            if last:
                self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        if self._probe is None:
            self._probe = LiveTensorBytes().__enter__()
        if last:
            self._probe.mark(reachable_tensor_bytes())
        try:
            yield
        except BaseException:
            self._probe.__exit__(None, None, None)
            self._probe = None
            raise
        if last:
            self._probe.__exit__(None, None, None)
            self.peak, self._probe = self._probe.peak, None


def event_name(event) -> str:
    """A profiler event tree node's name; "" where torch cannot decode it (seen for some events when
    the profiler also records stacks: reading the name raised UnicodeDecodeError and lost the whole
    count)."""
    try:
        return event.name
    except UnicodeDecodeError:
        return ""
