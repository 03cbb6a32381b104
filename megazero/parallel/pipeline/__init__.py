"""Pipeline parallelism: stage split, point-to-point exchange, schedules as data, tied embeddings.

Typical use, on every rank of a tp x pp (x dp) job (the model spec supplies chunks, shape and loss)::

    chunks = build_model_chunks(spec, job, topo)                  # megazero.spec
    shape = spec.boundary_shape(job.model, job.train.micro_batch_size, topo.model_groups(sp))
    losses = run_schedule(chunks, micro_batches, topo.pipeline(), loss_fn=spec.loss, schedule=job.parallel,
                          tensor_shape=shape, grad_sync=engine)   # per-micro-batch losses on the last stage
    engine.finalize_grads()
    engine.step()

Nothing here imports a model. Modules: ``partition`` (who holds which layers), ``actions`` (a schedule
as per-rank lists of compute and p2p-batch actions), ``generators`` (no-pipelining, GPipe, 1F1B and
the dispatcher) and ``interleaved`` (interleaved 1F1B) write those lists, ``simulate`` checks and
draws them, ``executor`` runs one rank's list with ``runner`` (one forward/backward of one
micro-batch) and ``p2p`` (batched isend/irecv); ``api``'s ``run_schedule`` ties them together.
``split_backward`` splits a micro-batch's backward into I (input gradient) and W (weight gradients)
on the autograd graph; ``zero_bubble`` (ZB-H1) and ``zero_bubble_v`` (ZB-V, two chunks per rank in
the V shape of ``partition``) write lists with I and W (``--pipeline-schedule zb-h1`` / ``zb-v``).
"""
from megazero.parallel.pipeline.actions import P2P, Action, Compute, Exchange, Kind, Op
from megazero.parallel.pipeline.api import run_schedule
from megazero.parallel.pipeline.executor import checked_schedule, execute
from megazero.parallel.pipeline.generators import (
                                                   GENERATORS,
                                                   default_schedule,
                                                   get_schedule,
                                                   gpipe,
                                                   no_pipelining,
                                                   one_f_one_b,
                                                   schedule_by_name,
)
from megazero.parallel.pipeline.interleaved import (
                                                   chunk_of,
                                                   interleaved_one_f_one_b,
                                                   interleaved_warmup,
                                                   micro_of,
)
from megazero.parallel.pipeline.p2p import StageComm
from megazero.parallel.pipeline.partition import (
                                                   LOOP,
                                                   StagePlacement,
                                                   V,
                                                   is_first_virtual_stage,
                                                   is_last_virtual_stage,
                                                   placements,
                                                   stage_layer_ids,
                                                   stage_position,
                                                   virtual_stage,
)
from megazero.parallel.pipeline.runner import PipelineStats, StageRunner
from megazero.parallel.pipeline.simulate import (
                                                   ScheduleError,
                                                   Timeline,
                                                   render,
                                                   simulate,
)
from megazero.parallel.pipeline.zero_bubble import zb_h1
from megazero.parallel.pipeline.zero_bubble_v import zb_v

__all__ = [
    "Action", "checked_schedule", "chunk_of", "Compute", "default_schedule", "Exchange", "execute", "GENERATORS",
    "get_schedule", "gpipe", "interleaved_one_f_one_b", "interleaved_warmup", "is_first_virtual_stage",
    "is_last_virtual_stage", "Kind", "micro_of", "no_pipelining", "one_f_one_b", "Op", "P2P", "PipelineStats",
    "placements", "render", "run_schedule", "ScheduleError", "schedule_by_name", "simulate", "StageComm",
    "StagePlacement", "StageRunner", "stage_layer_ids", "Timeline", "LOOP", "V", "stage_position", "virtual_stage",
    "zb_h1", "zb_v",
]
