"""``--profile``: a torch profiler trace of chosen training steps on chosen ranks.

Megatron-LM's flags and meaning: ``--profile-step-start N --profile-step-end M`` profile the steps
after iteration N up to iteration M (with the defaults 10 and 12, the log's iterations 11 and 12) on
the global ranks ``--profile-ranks`` (default 0). Each profiled rank writes one chrome trace,
``rank<R>.iter<N+1>-<M>.pt.trace.json``, into :func:`trace_dir`: open it in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``, or in TensorBoard's profiler plugin when it lies in
``--tensorboard-dir``. Every profiled step is one ``iteration <n>`` range in the trace, so the steps
are told apart at a glance. A run that ends (or stops) inside the window writes what it profiled.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megazero.config import LoggingConfig


def trace_dir(lg: LoggingConfig, save: str | None) -> str:
    """Where the traces go: ``--profile-dir``, else ``--tensorboard-dir`` (as Megatron-LM writes them,
    for TensorBoard's profiler plugin), else ``SAVE/profile``, else ``./profile``."""
    return lg.profile_dir or lg.tensorboard_dir or os.path.join(save or ".", "profile")


def describe(lg: LoggingConfig, save: str | None) -> str:
    """The start line of a profiled run (empty without ``--profile``)."""
    if not lg.profile:
        return ""
    ranks = " ".join(map(str, lg.profile_ranks))
    return (f" profiler: iterations {lg.profile_step_start + 1} to {lg.profile_step_end} on rank(s) {ranks}: "
            f"chrome traces in {trace_dir(lg, save)}")


class StepProfiler:
    """Wraps each training step (:meth:`step`); profiles those of the window on a profiled rank and
    writes the trace when the window closes (or at :meth:`close`, for a run that ends inside it).

    ``say`` reports the written file (every profiled rank prints its own)."""

    def __init__(self, lg: LoggingConfig, save: str | None, rank: int, device: torch.device, say=print):
        self.active = lg.profile and rank in lg.profile_ranks
        self.start, self.end = lg.profile_step_start, lg.profile_step_end
        self.rank, self.device, self.say = rank, device, say
        self.directory = trace_dir(lg, save)
        self._profiler = None
        self._first = self._last = None  # the first and last profiled iterations (a resumed run may start inside)
        self.path: str | None = None     # the trace written, once it is

    def step(self, iteration: int):
        """A context for the step that takes the run from ``iteration`` to ``iteration + 1``."""
        if not self.active or not self.start <= iteration < self.end:
            return nullcontext()
        if self._profiler is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profiler = profile(activities=activities, record_shapes=True)
            self._profiler.start()
            self._first = iteration + 1
        return _Step(self, iteration + 1)

    def close(self) -> None:
        """Stop a profile still running (the run ended or stopped inside the window) and write it."""
        if self._profiler is None:
            return
        prof, self._profiler = self._profiler, None
        prof.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"rank{self.rank}.iter{self._first}-{self._last}.pt.trace.json")
        prof.export_chrome_trace(self.path)
        self.say(f" profiler: rank {self.rank}'s trace of iterations {self._first} to {self._last} written to "
                 f"{self.path}")


class _Step:
    """One profiled step: an ``iteration <n>`` range; the window's last step closes the profile."""

    def __init__(self, profiler: StepProfiler, iteration: int):
        self.profiler, self.iteration = profiler, iteration
        self._range = record_function(f"iteration {iteration}")

    def __enter__(self):
        self._range.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._range.__exit__(*exc)
        self.profiler._last = self.iteration
        if self.iteration >= self.profiler.end and exc[0] is None:
            self.profiler.close()
