"""Configuration: one dataclass per component, and the one :func:`validate` that rejects bad
combinations before any process group, model or dataset exists.

* :mod:`~megazero.config.sections`: the dataclasses; each flag's spellings, help and help group live in
  its field's metadata, and the command line (:mod:`megazero.arguments`) is generated from them.
* :mod:`~megazero.config.checks`: each section's rules, run by its ``check`` method (the model's in
  :mod:`~megazero.config.model_checks`).
* :mod:`~megazero.config.fields`: the metadata helper, :func:`flag` and :class:`ConfigError`.

Library components take their own section; only entry points parse command lines::

    job = validate(JobConfig(parallel=ParallelConfig(tp=2)), world_size=4)   # job.parallel.dp == 2
    flag("num_attention_heads") == "--num-attention-heads"                   # how messages name it
"""
from __future__ import annotations

import dataclasses

from megazero.config.checks import check_context_parallel, check_finite, fill_zero_defaults
from megazero.config.fields import flag, flag_field, flag_fields, setting
from megazero.config.model_checks import check_model
from megazero.config.sections import (
    ACTIVATIONS,
    BACKENDS,
    COMPILE_MODES,
    DECAY_STYLES,
    NORMALIZATIONS,
    OFFLOAD_DEVICES,
    POSITION_EMBEDDING_TYPES,
    SCHEDULES,
    TOKENIZERS,
    ZERO_STAGES,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    ZeroConfig,
)
from megazero.errors import ConfigError

__all__ = ["ACTIVATIONS", "BACKENDS", "COMPILE_MODES", "CompileConfig", "DECAY_STYLES", "NORMALIZATIONS",
           "OFFLOAD_DEVICES", "POSITION_EMBEDDING_TYPES",
           "SCHEDULES", "TOKENIZERS", "ZERO_STAGES", "CheckpointConfig", "ConfigError", "DataConfig", "JobConfig",
           "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "TrainConfig",
           "ZeroConfig", "check_model", "flag", "flag_field", "flag_fields", "setting", "validate"]


def validate(job: JobConfig, world_size: int) -> JobConfig:
    """Check every field and combination; return a copy with the derived values filled in.

    Raises :class:`ConfigError` naming the offending flag and the fix. Call before creating any
    process group, model or dataset. Each section's ``check`` runs once, in this order (the first
    broken rule is the one reported). Derived values: ``parallel.dp`` (when None), the pipeline
    schedule and ``parallel.virtual_stages`` (interleaved with virtual pipeline stages),
    ``train.global_batch_size`` (when None), ``optimizer.lr_decay_iters`` and ``min_lr`` (from
    ``min_lr_ratio``), the ZeRO defaults that follow other sections (:func:`fill_zero_defaults`) and,
    with ``--profile``, the profiled steps and ranks.
    """
    job = JobConfig(**{f.name: dataclasses.replace(getattr(job, f.name)) for f in dataclasses.fields(job)})
    check_finite(job)
    job.parallel.check(world_size)
    job.model.check(job.parallel)
    job.train.check(job.parallel)
    job.precision.check()
    job.zero.check(job.parallel, world_size)
    job.optimizer.check(job.train)
    fill_zero_defaults(job)
    job.data.check()
    job.checkpoint.check()
    job.logging.check(job.train, world_size)
    job.compilation.check(job.model)
    check_context_parallel(job)
    return job
