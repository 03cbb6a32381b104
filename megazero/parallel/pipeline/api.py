"""``run_schedule``: the one call a trainer makes per step (forward + backward of all micro-batches)."""
from __future__ import annotations

import torch

from megazero.parallel.groups import PipelineLayout
from megazero.parallel.pipeline.actions import Compute, Kind
from megazero.parallel.pipeline.executor import (
    checked_schedule,
    execute,
    stage_shape_of,
)
from megazero.parallel.pipeline.generators import (
    default_schedule,
    get_schedule,
    no_pipelining,
    schedule_by_name,
)
from megazero.parallel.pipeline.p2p import StageComm
from megazero.parallel.pipeline.partition import LOOP
from megazero.parallel.pipeline.runner import GradSyncHooks, PipelineStats, StageRunner


def run_schedule(chunks, micro_batches, pipeline: PipelineLayout, *, loss_fn, forward_only: bool = False,
                 loss_scale: float = 1.0, grad_sync: GradSyncHooks | None = None, schedule=None, tensor_shape=None,
                 stats: PipelineStats | None = None) -> list[torch.Tensor]:
    """Run forward (and backward unless ``forward_only``) of every micro-batch through this rank's chunks.

    chunks: this rank's model chunks (built for ``pipeline``'s placements), chunk c = virtual stage
        c*pp + pp_rank. The last virtual stage's chunk is called as ``chunk(x, labels)``, the others
        as ``chunk(x)``.
    pipeline: this rank's pipeline layout (``topo.pipeline()``).
    micro_batches: list of dicts {"tokens": [b,s] int64, "labels": [b,s] int64, "loss_mask": [b,s]};
        the first stage reads tokens, the last labels and loss_mask; other entries may be None.
    loss_fn: ``loss_fn(last chunk's output, loss_mask) -> scalar``, the model's loss (e.g.
        the GPT family's masked mean over the per-token losses).
    loss_scale: each micro-batch loss is backpropagated as ``loss * loss_scale / len(micro_batches)``,
        so gradients are those of the mean loss (times the fp16 loss scale).
    grad_sync: the data-parallel engine's hooks (:class:`~megazero.parallel.pipeline.runner.GradSyncHooks`),
        called around each backward (the gradient reductions overlap it); None: no hooks.
    schedule: a schedule generator (``generators.py``), a name (a key of ``generators.GENERATORS``), a
        ParallelConfig, or None (no pipelining at pp=1, interleaved with several chunks, else 1F1B).
        Its action lists are checked by the simulator once per (schedule, pp, m, v) in the process.
    tensor_shape: the stage-boundary activation shape (the model's ``activation_shape``); needed
        when pp > 1, where receive buffers are allocated before anything arrives.
    stats: a :class:`PipelineStats` to fill (peak in-flight micro-batches, execution order, and with
        ``time_waits`` the seconds spent waiting for the pipeline p2p).

    Returns the detached per-micro-batch losses on the rank that holds the last virtual stage (the
    last pipeline rank; rank 0 in the V shape of zb-v), in micro-batch order (the trainer averages
    them); an empty list on other ranks.
    """
    generator = _resolve(schedule, pipeline.size, len(chunks))
    stats = stats if stats is not None else PipelineStats()
    stats.reset(getattr(generator, "__name__", str(generator)))
    shape = stage_shape_of(generator)
    runner = StageRunner(chunks, micro_batches, pipeline, forward_only=forward_only, loss_scale=loss_scale,
                         grad_sync=grad_sync, stats=stats, loss_fn=loss_fn, shape=shape)
    actions = checked_schedule(generator, pipeline.size, runner.num_micro, runner.v, forward_only)[pipeline.rank]
    runner.split_backward = not forward_only and any(
        isinstance(a, Compute) and a.kind is Kind.BACKWARD_INPUT for a in actions)
    comm = None
    if pipeline.size > 1:
        if tensor_shape is None:
            raise ValueError(f"run_schedule on pipeline rank {pipeline.rank} of {pipeline.size} needs tensor_shape: "
                             f"the model spec's boundary_shape(model_cfg, micro_batch_size, model groups)")
        # Several chunks in the loop: the last rank's chunk c feeds rank 0's chunk c+1 (a ring); the V
        # turns on the last rank without a message.
        comm = StageComm(pipeline, tensor_shape, _param_dtype(chunks), ring=runner.v > 1 and shape == LOOP,
                         time_waits=stats.time_waits)
    execute(actions, runner, comm)
    if comm is not None:
        comm.flush()
        stats.wait_s = comm.wait_s or 0.0
    return runner.losses if runner.holds_loss else []


def _resolve(schedule, pp: int, num_chunks: int):
    if schedule is None:
        return default_schedule(pp, num_chunks)
    if callable(schedule):
        return schedule
    if isinstance(schedule, str):
        return no_pipelining if pp == 1 else schedule_by_name(schedule)
    return get_schedule(schedule)                 # a ParallelConfig


def _param_dtype(chunks) -> torch.dtype:
    for chunk in chunks:
        for p in chunk.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32
