"""Pipeline parallelism: stage split, point-to-point exchange, schedules, tied embeddings.

Typical use, on every rank of a tp x pp (x dp) job (the model spec supplies chunks, shape and loss)::

    chunks = build_model_chunks(spec, job, topo)                  # megazero.models.spec
    shape = spec.boundary_shape(job.model, job.train.micro_batch_size, topo.model_groups(sp))
    losses = run_schedule(chunks, micro_batches, topo.pipeline(), loss_fn=spec.loss, schedule=job.parallel,
                          tensor_shape=shape, grad_sync=engine)   # per-micro-batch losses on the last stage
    engine.finalize_grads()
    engine.step()

Nothing here imports a model. Modules: ``partition`` (who holds which layers), ``p2p`` (batched isend/irecv),
``runner`` (one forward/backward of one micro-batch), ``schedules`` (no-pipelining, GPipe, 1F1B and
the dispatcher), ``interleaved`` (interleaved 1F1B).
"""
from megazero.parallel.pipeline.api import run_schedule
from megazero.parallel.pipeline.interleaved import chunk_of, interleaved_one_f_one_b, interleaved_warmup
from megazero.parallel.pipeline.p2p import StageComm
from megazero.parallel.pipeline.runner import PipelineStats, StageRunner
from megazero.parallel.pipeline.schedules import (default_schedule, get_schedule, gpipe, no_pipelining,
                                                  one_f_one_b, schedule_by_name)
from megazero.parallel.pipeline.partition import (StagePlacement, is_first_virtual_stage, is_last_virtual_stage,
                                                  placements, stage_layer_ids)

__all__ = [
    "chunk_of", "default_schedule", "get_schedule", "gpipe", "interleaved_one_f_one_b", "interleaved_warmup",
    "is_first_virtual_stage", "is_last_virtual_stage", "no_pipelining", "one_f_one_b", "PipelineStats",
    "placements", "run_schedule", "StagePlacement", "schedule_by_name", "StageComm", "StageRunner", "stage_layer_ids",
]
