"""The model spec: everything the trainer, checkpoints, the memory estimator and the tools need from a
model family, in one object found by name (``--model-family``). Nothing outside ``megazero/models/``
imports a concrete model; it asks the registry for the spec.

    spec = get_model_spec(job.model.model_family)             # "gpt": GPT-2 and the Llama family
    chunks = build_model_chunks(spec, job, topo)              # this rank's pipeline chunks
    shape = spec.boundary_shape(job.model, micro_batch, topo.model_groups(sp))
    loss = spec.loss(last_chunk(x, labels), loss_mask)        # the scalar each micro-batch back-propagates
    model = spec.build_full(job.model, seed=...)              # one process, every layer: tools, generation

What a spec supplies (``ModelSpec``'s fields):

=====================  ===========================================================  ======================
field                  what                                                         used by
=====================  ===========================================================  ======================
``build_chunk``        one pipeline chunk for a :class:`StagePlacement` (its layers, the trainer, tools,
                       first/last stage) and the model-parallel groups; parameter    checkpoints, estimator
                       names are the whole model's, parameters carry the attributes
                       of :mod:`megazero.parallel.params`, ``zero3_plan()`` and
                       ``initial_value(name)`` (layout-independent init) as a chunk
                       should (see :mod:`megazero.parallel.zero.units`,
                       :mod:`megazero.parallel.zero.materialize`)
``boundary_shape``     the activation passed between stages                         the pipeline
``loss``               (last chunk's output, loss mask) -> scalar                   the pipeline
``flops_per_token``    training FLOPs per token (MFU, TFLOP/s), given the share of  the log line
                       the layers' forward that recompute runs again
``recomputed_share``   that share for the job's recompute flags (default: 1 with    the log line
                       full recompute, else 0)
``checkpoint_fields``  ModelConfig fields a checkpoint must match to be loaded      --load, preflight
``check``              model-specific rules (raise ConfigError naming the flag)     validate()
``describe``           the architecture in a few words, for the first log line      the trainer
``hooks``              per-step hooks and metrics (:class:`StepHooks`)              the training loop
``hf``                 HuggingFace conversion (:class:`HFAdapter`), or None         tools/convert, export
``activation_bytes``   bytes one micro-batch leaves held in a chunk, or None for    the estimator
                       the generic transformer formula
``compile_regions``    the modules of a chunk ``--compile`` compiles one by one     megazero/compile.py
                       (regional compilation), or None: the family cannot compile
``context_parallel``   whether its chunks take a sequence split over cp ranks       validate()
                       (positions, attention and loss; :mod:`megazero.parallel.context`)
=====================  ===========================================================  ======================

A new model family is a module in ``megazero/models/`` (or anywhere: a test file registers its own)
that builds a ``ModelSpec`` and calls :func:`register_model_spec`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from megazero.config import JobConfig, ModelConfig, ParallelConfig
from megazero.errors import ConfigError
from megazero.parallel.groups import ModelParallelGroups
from megazero.parallel.pipeline.generators import stage_shape
from megazero.parallel.pipeline.partition import StagePlacement, placements


@dataclass(frozen=True)
class StepHooks:
    """What a model does around each training step beyond forward and backward (default: nothing).

    ``before_step(chunks, loss_scale)``: before the step's first forward; ``loss_scale`` is what each
    micro-batch's loss is multiplied by before backward (fp16 scale / micro-batches), e.g. for
    auxiliary losses that back-propagate outside the pipeline's loss. ``metrics(chunks, job,
    tp_rank, steps, device) -> dict``: extra log fields averaged over the last ``steps`` steps (a
    collective: every rank calls it at every log line); ``describe_metrics(dict) -> str``: their part
    of the console line."""

    before_step: Callable[[list, float], None] = lambda chunks, loss_scale: None
    metrics: Callable[..., dict] = lambda chunks, job, tp_rank, steps, device: {}
    describe_metrics: Callable[[dict], str] = lambda metrics: ""


@dataclass(frozen=True)
class HFAdapter:
    """HuggingFace conversion of one model family (whole, layout-free tensors on both sides).

    ``model_types``: the HF ``model_type`` values it reads; ``config_from_hf(hf_config, seq_length)``
    -> ModelConfig; ``hf_config(cfg)`` -> the HF config dict (refusing what the format cannot express;
    the tokenizer's ``bos_token_id`` / ``eos_token_id`` are added by the writer);
    ``to_hf_state(tensors, cfg)`` / ``from_hf_state(state, cfg)`` map the tensors."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, int | None], ModelConfig]
    hf_config: Callable[[ModelConfig], dict]
    to_hf_state: Callable[[dict, ModelConfig], dict]
    from_hf_state: Callable[[dict, ModelConfig], dict]


@dataclass(frozen=True)
class ModelSpec:
    """One model family (see the module docstring for each field)."""

    name: str
    build_chunk: Callable[..., nn.Module]
    boundary_shape: Callable[[ModelConfig, int, ModelParallelGroups], tuple[int, ...]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_token: Callable[[ModelConfig, int, float], float]
    checkpoint_fields: tuple[str, ...] = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                          "vocab_size", "max_position_embeddings")
    check: Callable[[ModelConfig, ParallelConfig], None] = lambda model_cfg, parallel_cfg: None
    describe: Callable[[ModelConfig], str] = lambda model_cfg: ""
    hooks: StepHooks = field(default_factory=StepHooks)
    hf: HFAdapter | None = None
    activation_bytes: Callable[..., int] | None = None
    compile_regions: Callable[[nn.Module], list[nn.Module]] | None = None
    recomputed_share: Callable[[ModelConfig, ParallelConfig], float] = (
        lambda model_cfg, parallel_cfg: float(model_cfg.recompute_granularity == "full"))
    context_parallel: bool = False

    def build_full(self, model_cfg: ModelConfig, *, seed: int = 1234, dtype: torch.dtype = torch.float32,
                   device=None) -> nn.Module:
        """The whole model in one process (tp = pp = 1): what tools, conversion and generation use."""
        return self.build_chunk(model_cfg, StagePlacement.whole(model_cfg.num_layers), ModelParallelGroups.single(),
                                seed=seed, dtype=dtype, device=device)

    def meta_chunks(self, model_cfg: ModelConfig, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[nn.Module]:
        """Pipeline rank ``pp_rank``'s chunks at tp = 1 on the meta device: every parameter's name,
        shape and declarations, no memory (for tools)."""
        return [self.build_chunk(model_cfg, placement, ModelParallelGroups.single(), device="meta")
                for placement in placements(model_cfg.num_layers, pp, pp_rank, virtual_stages)]


_REGISTRY: dict[str, ModelSpec] = {}
# Built-in families, imported on first use so that importing this module imports no model.
_BUILTIN = {"gpt": "megazero.models.gpt_spec"}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Make ``spec`` findable by ``spec.name`` (``--model-family``); returns it. Registering a name again
    replaces the earlier spec (a test re-registering its model in a reused worker process)."""
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; a ConfigError naming ``--model-family`` and the known names."""
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        raise ConfigError(f"--model-family {name!r} is not a registered model: use one of "
                          f"{', '.join(model_family_names())} (or register a ModelSpec of that name first)")
    return _REGISTRY[name]


def model_family_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def spec_for_hf(model_type: str) -> ModelSpec:
    """The spec whose HF adapter reads ``model_type`` (GPT-2 when absent from an HF config)."""
    for name in _BUILTIN:
        get_model_spec(name)
    for spec in _REGISTRY.values():
        if spec.hf is not None and model_type in spec.hf.model_types:
            return spec
    known = sorted(t for s in _REGISTRY.values() if s.hf is not None for t in s.hf.model_types)
    raise ConfigError(f"cannot import this HF model: model_type {model_type!r} (megazero reads {', '.join(known)})")


def build_model_chunks(spec: ModelSpec, job: JobConfig, topo, *, dtype: torch.dtype = torch.float32,
                       device=None) -> list[nn.Module]:
    """This rank's ``v`` chunks (``v = job.parallel.virtual_stages``; 1 unless interleaved or zb-v), chunk c
    being virtual stage ``c * pp + pp_rank`` (in the V of zb-v, odd chunks ``c * pp + pp - 1 - pp_rank``:
    :func:`megazero.parallel.pipeline.partition.placements`).
    ``device="meta"`` allocates nothing (the ZeRO engine then materialises each parameter where it
    lives, from the chunk's ``initial_value``)."""
    par = job.parallel
    if par.pp != topo.pp_size or par.tp != topo.tp_size or par.cp != topo.cp_size:
        raise ValueError(f"parallel config (tp {par.tp}, cp {par.cp}, pp {par.pp}) does not match the topology "
                         f"(tp {topo.tp_size}, cp {topo.cp_size}, pp {topo.pp_size}): build both from the same config")
    groups = topo.model_groups(par.sequence_parallel, par.cp_comm_type)
    return [spec.build_chunk(job.model, placement, groups, seed=job.train.seed, dtype=dtype,
                             device=device if device is not None else topo.device, home_device=topo.device)
            for placement in placements(job.model.num_layers, topo.pp_size, topo.pp_rank, par.virtual_stages,
                                        stage_shape(par))]


def check_family(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, compile_cfg=None) -> None:
    """The model rules beside ``validate()``'s: the family is registered, its spec's ``check`` passes, and
    it names compile regions when ``--compile`` asks for them."""
    spec = get_model_spec(model_cfg.model_family)
    spec.check(model_cfg, parallel_cfg)
    if parallel_cfg.cp > 1 and not spec.context_parallel:
        raise ConfigError(f"--context-parallel-size {parallel_cfg.cp}: --model-family {spec.name} cannot take a "
                          f"sequence split over ranks (ModelSpec.context_parallel): drop --context-parallel-size")
    if compile_cfg is not None and compile_cfg.compile and spec.compile_regions is None:
        raise ConfigError(f"--model-family {spec.name} names no regions to compile (ModelSpec.compile_regions): "
                          f"drop --compile")
