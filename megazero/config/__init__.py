"""Configuration: one module per section, each holding its dataclass, its flags (field metadata) and its
``check``; :func:`validate` is the one entry point that checks a job, before any process group, model or
dataset exists.

=====================  =====================================================================
module                 section
=====================  =====================================================================
``model``              ``ModelConfig``: what every model family has (sizes, activation memory),
                       and the registry of families' config classes (``--model-family``)
``parallel``           ``ParallelConfig``: tp, cp, pp, dp, ep, the rank order, the schedule
``zero``               ``ZeroConfig``: the ZeRO stage, offload, ZeRO++
``precision``          ``PrecisionConfig``: bf16 / fp16 and loss scaling
``optimizer``          ``OptimizerConfig``: AdamW and the learning-rate schedule
``train``              ``TrainConfig``: batch sizes, length, seed, evaluation and logging rhythm
``data``               ``DataConfig``: the data and its tokenizer
``checkpoint``         ``CheckpointConfig``: saving and resuming
``logging``            ``LoggingConfig``: metrics files, TensorBoard, W&B, the profiler
``compile``            ``CompileConfig``: torch.compile
``fault_tolerance``    ``FaultToleranceConfig``: replica groups as separate jobs joined by torchft
``job``                ``JobConfig`` (every section) and ``validate``
``fields``, ``rules``  the flag metadata (``flag_field``, ``flag``) and the vocabulary of checks
``megatron_flags``     Megatron-LM's flags and what each is here
=====================  =====================================================================

Library components take their own section; only entry points parse command lines::

    job = validate(JobConfig(parallel=ParallelConfig(tp=2)), world_size=4)   # job.parallel.dp == 2
    flag("num_attention_heads") == "--num-attention-heads"                   # how messages name it
"""
from megazero.config.checkpoint import CheckpointConfig
from megazero.config.compile import COMPILE_MODES, CompileConfig
from megazero.config.data import TOKENIZERS, DataConfig
from megazero.config.fault_tolerance import FaultToleranceConfig
from megazero.config.fp8 import FP8Config
from megazero.config.fields import FLAG, flag, flag_field, flag_fields, flag_off, setting
from megazero.config.job import JobConfig, validate
from megazero.config.logging import LoggingConfig
from megazero.config.model import ModelConfig
from megazero.config.optimizer import DECAY_STYLES, OptimizerConfig
from megazero.config.parallel import BACKENDS, SCHEDULES, ParallelConfig
from megazero.config.precision import PrecisionConfig
from megazero.config.train import TrainConfig
from megazero.config.zero import OFFLOAD_DEVICES, ZERO_STAGES, ZeroConfig

__all__ = ["BACKENDS", "COMPILE_MODES", "DECAY_STYLES", "FLAG", "OFFLOAD_DEVICES", "SCHEDULES", "TOKENIZERS",
           "ZERO_STAGES", "CheckpointConfig", "CompileConfig", "DataConfig", "FaultToleranceConfig", "FP8Config", "JobConfig", "LoggingConfig",
           "ModelConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "TrainConfig", "ZeroConfig",
           "flag", "flag_field", "flag_fields", "flag_off", "setting", "validate"]
