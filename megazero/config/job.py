"""The job: every section of a run, and :func:`validate`, the one entry point that checks it.

    job = validate(JobConfig(parallel=ParallelConfig(tp=2)), world_size=4)   # job.parallel.dp == 2

``validate`` runs each section's ``check`` once, in a fixed order (the first broken rule is the one
reported), the model family's rules among them (``job.model`` is of the family's config class:
:mod:`megazero.config.model`). Everything after it -- the topology, the model, the ZeRO engine, the
estimator -- trusts a validated job.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megazero.config.checkpoint import CheckpointConfig
from megazero.config.compile import CompileConfig
from megazero.config.data import DataConfig
from megazero.config.fault_tolerance import FaultToleranceConfig
from megazero.config.fields import register_sections, setting
from megazero.config.fp8 import FP8Config
from megazero.config.logging import LoggingConfig
from megazero.config.model import (
    ModelConfig,
    check_family,
    family,
    model_config,
    registered_families,
)
from megazero.config.optimizer import OptimizerConfig
from megazero.config.parallel import ParallelConfig
from megazero.config.precision import PrecisionConfig
from megazero.config.rules import fail
from megazero.config.train import TrainConfig
from megazero.config.zero import ZeroConfig
from megazero.errors import ConfigError


def default_model() -> ModelConfig:
    """The default family's config class with its defaults (``--model-family gpt``)."""
    return family(ModelConfig.model_family).config()


@dataclass
class JobConfig:
    """Every section of a run; :func:`validate` checks and completes it."""

    model: ModelConfig = field(default_factory=default_model)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    compilation: CompileConfig = field(default_factory=CompileConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation steps); under a batch-size
        schedule, those of its largest batch (what the memory estimate must hold)."""
        assert self.parallel.dp is not None, "validate() resolves dp first"
        return self.train.largest_global_batch // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, sections: dict, *, strict: bool = True) -> JobConfig:
        """A JobConfig from ``{section: {field: value}}`` (what :meth:`to_dict` gives), starting from the
        dataclass defaults; the model section is its family's class (``model_family``). Each section is
        constructed afresh, so derived defaults such as ``ffn_hidden_size = 4 * hidden_size`` follow the
        given values. ``strict=False`` drops unknown sections and fields (a config saved by a newer
        version); otherwise they are an error."""
        kinds = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        unknown = set(sections) - set(kinds)
        if unknown and strict:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)}: expected {sorted(kinds)}")
        built = {}
        for name, kind in kinds.items():
            values = dict(sections.get(name) or {})
            if name == "model":
                built[name] = model_config(values, strict=strict)
                continue
            known = {f.name for f in dataclasses.fields(kind)}
            extra = set(values) - known
            if extra and strict:
                raise ConfigError(f"unknown {name} setting(s) {sorted(extra)}")
            built[name] = kind(**{k: v for k, v in values.items() if k in known})
        return cls(**built)


def _sections():
    """(section name, dataclass) of every section: the model's base class and each family's class."""
    for f in dataclasses.fields(JobConfig):
        if f.name != "model":
            yield f.name, f.default_factory
            continue
        yield "model", ModelConfig
        for entry in registered_families():
            yield "model", entry.config


register_sections(_sections)


def validate(job: JobConfig, world_size: int) -> JobConfig:
    """Check every field and combination; return a copy with the derived values filled in.

    Raises :class:`ConfigError` naming the offending flag and the fix. Call before creating any
    process group, model or dataset. The order: finite numbers, the layout against the world size,
    the model's rules (its family's own included) and its layers over the pipeline stages, the family
    (registered, the section of its class, what its layers can take: a split sequence, compilation),
    then training, precision, ZeRO, the optimizer, data, checkpoints, logging and compilation. Derived
    values: ``parallel.dp`` (when None), the pipeline schedule and
    ``parallel.virtual_stages`` (interleaved with virtual pipeline stages), ``train.global_batch_size``
    and ``train_iters``, ``optimizer.lr_decay_iters`` and ``min_lr`` (from ``min_lr_ratio``), the ZeRO
    defaults that follow other sections (:meth:`ZeroConfig.fill_defaults`) and, with ``--profile``, the
    profiled steps and ranks.
    """
    job = JobConfig(**{f.name: dataclasses.replace(getattr(job, f.name)) for f in dataclasses.fields(job)})
    check_finite(job)
    job.parallel.check(world_size)
    job.model.check(job.parallel)
    job.parallel.check_layers(job.model.num_layers)
    job.model.check_chunk_layers(job.parallel)
    check_family(job)
    job.train.check(job.parallel, job.model)
    job.precision.check()
    job.fp8.check(job.zero.zero_stage, job.zero.quantized_weights)
    job.zero.check(job.parallel, world_size)
    job.optimizer.check(job.train, job.zero)
    job.zero.fill_defaults(job.model, job.precision, job.parallel.tp)
    job.data.check()
    job.checkpoint.check()
    job.fault_tolerance.check(job.parallel, job.zero, job.train)
    job.logging.check(job.train, world_size)
    job.compilation.check(job.model, job.parallel, job.fp8)
    job.zero.settle_gradient_accumulation_fusion(job.precision, job.parallel, job.fp8.enabled, job.compilation.compile)
    return job


def check_finite(job: JobConfig) -> None:
    """Every float setting of every section is a real number: nan and inf pass every comparison check
    (comparisons with nan are false), so they are refused first, by name."""
    for section in dataclasses.fields(job):
        for f in dataclasses.fields(getattr(job, section.name)):
            value = getattr(getattr(job, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                fail(f"{setting(f.name)} must be a finite number, got {value}")
