"""Forward and backward of one micro-batch through one model chunk, with the bookkeeping every
schedule shares: the activations kept for backward (per chunk and micro-batch), the losses of the
last stage, the gradient-sync hook and the in-flight count. ``executor.py`` calls it for each
compute action of a rank's list.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megazero.parallel.groups import PipelineLayout
from megazero.parallel.pipeline.partition import (
    LOOP,
    is_first_virtual_stage,
    is_last_virtual_stage,
)
from megazero.parallel.pipeline.split_backward import backward_input, deferrable_saves


class GradSyncHooks(Protocol):
    """What the runner calls on its ``grad_sync`` (the ZeRO engine) around a chunk's backward, so that
    gradient buckets are reduced as the backward fills them: ``before_backward(chunk, last)`` before a
    full backward (``last``: the step's last micro-batch through this chunk, whose gradients complete the
    buckets); ``before_input_grad(chunk)`` before a split backward's input half (I) and, around its weight
    half (W), ``with weight_grad(chunk, last):``."""

    def before_backward(self, chunk_id: int, is_last_microbatch: bool) -> None: ...

    def before_input_grad(self, chunk_id: int) -> None: ...

    def weight_grad(self, chunk_id: int, is_last_microbatch: bool) -> AbstractContextManager[None]: ...


@dataclass
class PipelineStats:
    """What one schedule run did on this rank (pass one to ``run_schedule(stats=...)``).

    ``peak_in_flight``: the most micro-batches whose forward had run and whose backward had not,
    summed over this rank's chunks: the number of activation sets held at once. 1F1B promises
    ``<= pp - pp_rank``; GPipe holds all ``m``.

    ``time_waits`` (set it before the run; off by default, and then no clock is read): ``wait_s`` is the
    seconds this rank spent waiting for its pipeline receives (and, at the step's end, its sends) --
    its idle time, whose share of the step is the measured bubble.

    ``time_computes`` (likewise off by default): ``compute_s`` and ``computes`` add up, per compute kind
    ("F", "B", "I", "W"), the seconds this rank spent in that kind's calls and their number -- the
    measured costs a schedule's theory can be replayed with (``zero_bubble.theory(durations=...)``).
    """

    schedule: str = ""
    num_forward: int = 0
    num_backward: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    order: list = field(default_factory=list)   # ("F" | "B" | "I" | "W", chunk, micro-batch) in execution order
    time_waits: bool = False
    wait_s: float = 0.0
    time_computes: bool = False
    compute_s: dict = field(default_factory=dict)   # kind letter -> seconds, with time_computes
    computes: dict = field(default_factory=dict)    # kind letter -> calls, with time_computes

    def reset(self, schedule: str) -> None:
        self.schedule, self.num_forward, self.num_backward = schedule, 0, 0
        self.in_flight = self.peak_in_flight = 0
        self.wait_s = 0.0
        self.order = []
        self.compute_s, self.computes = {}, {}

    def add_compute(self, kind: str, seconds: float) -> None:
        """One compute call of ``kind`` ("F", "B", "I", "W") that took ``seconds`` (with time_computes)."""
        self.compute_s[kind] = self.compute_s.get(kind, 0.0) + seconds
        self.computes[kind] = self.computes.get(kind, 0) + 1


class StageRunner:
    """Runs this rank's chunks on the step's micro-batches, one forward or backward at a time.

    ``chunks[c]`` is virtual stage ``partition.virtual_stage(pp_rank, pp, c, shape)`` (``c * pp +
    pp_rank`` in the loop shape). The schedule names the chunk and the micro-batch of each call;
    ``losses`` lists the last stage's losses in micro-batch order.
    """

    def __init__(self, chunks, micro_batches, pipeline: PipelineLayout, *, loss_fn, forward_only: bool = False,
                 loss_scale: float = 1.0, grad_sync: GradSyncHooks | None = None,
                 stats: PipelineStats | None = None, shape: str = LOOP):
        self.shape = shape
        self.chunks, self.micro_batches, self.pipeline = list(chunks), list(micro_batches), pipeline
        self.num_micro, self.v = len(self.micro_batches), len(self.chunks)
        if self.num_micro == 0:
            raise ValueError("run_schedule needs at least one micro-batch")
        self.forward_only, self.loss_scale, self.grad_sync = forward_only, loss_scale, grad_sync
        self.split_backward = False   # set when the rank's list has I actions: forwards then run in deferrable_saves
        self.stats = stats if stats is not None else PipelineStats()
        self.loss_fn = loss_fn
        self._losses: dict[int, torch.Tensor] = {}
        self.done_backward = [0] * self.v
        self.forwarded: set[tuple[int, int]] = set()
        self.held: list[dict] = [{} for _ in range(self.v)]     # chunk -> {micro-batch: (input, output)}
        self.pending_w: list[dict] = [{} for _ in range(self.v)]  # chunk -> {micro-batch: WeightGradWork}

    @property
    def losses(self) -> list[torch.Tensor]:
        """The detached micro-batch losses computed so far (last stage), in micro-batch order."""
        return [self._losses[i] for i in sorted(self._losses)]

    def is_first(self, c: int) -> bool:
        return is_first_virtual_stage(self.pipeline.rank, c)

    def is_last(self, c: int) -> bool:
        return is_last_virtual_stage(self.pipeline.rank, self.pipeline.size, c, self.v, self.shape)

    @property
    def holds_loss(self) -> bool:
        """True on the rank that runs the last virtual stage (the loss)."""
        return self.is_last(self.v - 1)

    def _batch(self, i: int, key: str) -> torch.Tensor:
        mb = self.micro_batches[i]
        if mb is None or mb.get(key) is None:
            raise ValueError(f"micro-batch {i} has no {key!r}, which pipeline rank {self.pipeline.rank} needs")
        return mb[key].to(self.pipeline.device)

    def forward(self, c: int, i: int, received: torch.Tensor | None) -> torch.Tensor | None:
        """Forward of chunk c on micro-batch i. ``received`` is the activation from the previous
        virtual stage (None on the first). Returns the activation to send on, or None on the last
        virtual stage (which records the micro-batch loss instead)."""
        if not 0 <= i < self.num_micro or (c, i) in self.forwarded:
            raise RuntimeError(f"schedule bug: forward of chunk {c} micro-batch {i} of {self.num_micro} "
                               f"(out of range or run twice)")
        self.forwarded.add((c, i))
        first, last = self.is_first(c), self.is_last(c)
        if first:
            x = self._batch(i, "tokens")
        else:
            if received is None:
                raise RuntimeError(f"schedule bug: chunk {c} micro-batch {i} has no input activation")
            x = received.requires_grad_(not self.forward_only)
        saves = deferrable_saves() if self.split_backward else contextlib.nullcontext()
        with torch.set_grad_enabled(not self.forward_only), saves:
            out = self.chunks[c](x, self._batch(i, "labels") if last else None)
            if last:
                loss = self.loss_fn(out, self._batch(i, "loss_mask"))
                self._losses[i] = loss.detach()
                out = loss * (self.loss_scale / self.num_micro)
        s = self.stats
        s.num_forward += 1
        s.order.append(("F", c, i))
        if not self.forward_only:
            self.held[c][i] = (None if first else x, out)
            s.in_flight += 1
            s.peak_in_flight = max(s.peak_in_flight, s.in_flight)
        return None if last else out

    def backward(self, c: int, i: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of chunk c on micro-batch i. ``output_grad`` is the gradient from the next
        virtual stage (None on the last, whose output is the scaled loss). Returns the gradient of
        the chunk's input, to send back (None on the first virtual stage)."""
        if i not in self.held[c]:
            raise RuntimeError(f"schedule bug: backward of chunk {c} micro-batch {i}, whose activations are not held")
        x, out = self.held[c].pop(i)
        self.done_backward[c] += 1
        if self.grad_sync is not None:
            self.grad_sync.before_backward(c, self.done_backward[c] == self.num_micro)
        if self.is_last(c):
            out.backward()
        else:
            if output_grad is None:
                raise RuntimeError(f"schedule bug: chunk {c} micro-batch {i} has no output gradient")
            torch.autograd.backward(out, grad_tensors=output_grad)
        s = self.stats
        s.num_backward += 1
        s.in_flight -= 1
        s.order.append(("B", c, i))
        return None if x is None else x.grad

    def backward_input(self, c: int, i: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """I of chunk c on micro-batch i (zero-bubble schedules): the gradient of the chunk's input
        only, to send back; the parameters' gradients wait for :meth:`backward_weight`. The
        micro-batch keeps until then only what W needs (``split_backward.py``) when ``split_backward`` was
        set before its forward (its saved tensors were then recorded for I to free); else all of them."""
        if i not in self.held[c]:
            raise RuntimeError(f"schedule bug: I of chunk {c} micro-batch {i}, whose activations are not held")
        x, out = self.held[c].pop(i)
        if not self.is_last(c) and output_grad is None:
            raise RuntimeError(f"schedule bug: chunk {c} micro-batch {i} has no output gradient")
        if self.grad_sync is not None:
            self.grad_sync.before_input_grad(c)
        self.pending_w[c][i] = backward_input(out, None if self.is_last(c) else output_grad, x)
        self.stats.order.append(("I", c, i))
        if x is None:
            return None
        dx, x.grad = x.grad, None                 # sent on, not held by the graph until W
        return dx

    def backward_weight(self, c: int, i: int) -> None:
        """W of chunk c on micro-batch i: the parameters' gradients its I left, with the gradient
        sync told (the step's last W of a chunk is the one whose gradients are reduced)."""
        if i not in self.pending_w[c]:
            raise RuntimeError(f"schedule bug: W of chunk {c} micro-batch {i} before its I (or twice)")
        work = self.pending_w[c].pop(i)
        self.done_backward[c] += 1
        if self.grad_sync is None:
            work.run()
        else:
            with self.grad_sync.weight_grad(c, self.done_backward[c] == self.num_micro):
                work.run()
        s = self.stats
        s.num_backward += 1
        s.in_flight -= 1
        s.order.append(("W", c, i))
