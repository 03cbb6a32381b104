"""The model spec: everything the trainer, checkpoints, the memory estimator and the tools need from a
model family, in one object found by name (``--model-family``). Nothing outside ``megazero/models/``
imports a concrete model; it asks the registry (:mod:`megazero.spec.registry`) for the spec.

    spec = get_model_spec(job.model.model_family)             # "gpt": GPT-2 and the Llama family
    chunks = build_model_chunks(spec, job, topo)              # this rank's pipeline chunks
    shape = spec.boundary_shape(job.model, micro_batch, topo.model_groups(sp))
    loss = spec.loss(last_chunk(x, labels), loss_mask)        # the scalar each micro-batch back-propagates
    model = spec.build_full(job.model, seed=...)              # one process, every layer: tools, generation

What a spec supplies (``ModelSpec``'s fields):

=====================  ===========================================================  ======================
field                  what                                                         used by
=====================  ===========================================================  ======================
``config``             the family's config class (a :class:`~megazero.config.       the command line,
                       ModelConfig` subclass: its own flags and rules, its          validate(), checkpoints
                       ``check``)
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
``checkpoint_fields``  config fields a checkpoint must match to be loaded           --load, preflight
``describe``           the architecture in a few words, for the first log line      the trainer
``hooks``              per-step hooks and metrics (:class:`StepHooks`)              the training loop
``hf``                 HuggingFace conversion (:class:`HFAdapter`), or None         tools/convert, export
``activation_bytes``   bytes one micro-batch leaves held in a chunk                 the estimator
                       (:class:`~megazero.spec.activations.ActivationModel`), or
                       None for the generic transformer formula
``compile_regions``    the modules of a chunk ``--compile`` compiles one by one     megazero/compile.py
                       (regional compilation), or None: the family cannot compile   (validate() refuses)
``context_parallel``   whether its chunks take a sequence split over cp ranks       validate()
                       (positions, attention and loss; :mod:`megazero.parallel.context`)
``is_expert``          (parameter name) -> whether it belongs to an expert of an    gathering a whole
                       MoE layer (expert-parallel ranks hold different ones)        model from its ranks
``fp8_layers``         (chunk, head) -> the chunk's linear layers that may run in   --fp8-format
                       FP8 (:class:`~megazero.parallel.fp8.FP8Layer`: how each is   (validate() refuses
                       split, expert or not), the output layer with ``head``; None  without it)
                       if the family has none
``tiny_models``        flags of tiny models of the family for tests and the fuzzer: tools/fuzz/sampler.py
                       (variant name, flags) pairs, the flags added to the shared   (the model family
                       tiny model (hidden 32, 4 heads, seq 16, vocab 100) for the   axis), tests
                       family's rules to accept it and train it in seconds; the
                       first pair (name "") the plain tiny model, the others its
                       optional parts (drawn as ``<family>+<variant>``); empty: the
                       shared flags alone (the default family's own variants are
                       the fuzzer's model axes)
=====================  ===========================================================  ======================

A new model family is a package in ``megazero/models/`` (or anywhere: a test file registers its own)
that defines its config class, builds a ``ModelSpec`` and calls
:func:`megazero.spec.register_model_spec`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import nn

from megazero.config import ModelConfig, ParallelConfig
from megazero.parallel.groups import ModelParallelGroups
from megazero.parallel.pipeline.partition import StagePlacement, placements
from megazero.spec.activations import ActivationModel


class ChunkBuilder(Protocol):
    """How a family builds one pipeline chunk: ``placement`` says its layers and whether it holds the
    embedding (first stage) and the head (last stage); ``groups`` the model-parallel groups it splits
    over; ``device="meta"`` declares the parameters without memory (``home_device`` is where they will
    live)."""

    def __call__(self, model_cfg: ModelConfig, placement: StagePlacement, groups: ModelParallelGroups, *,
                 seed: int = ..., dtype: torch.dtype | None = ..., device=..., home_device=...) -> nn.Module: ...


@dataclass(frozen=True)
class StepHooks:
    """What a model does around each training step beyond forward and backward (default: nothing).

    ``before_step(chunks, loss_scale)``: before the step's first forward; ``loss_scale`` is what each
    micro-batch's loss is multiplied by before backward (fp16 scale / micro-batches), e.g. for
    auxiliary losses that back-propagate outside the pipeline's loss. ``metrics(chunks, job,
    tp_rank, steps, device) -> dict``: extra log fields averaged over the last ``steps`` steps (a
    collective: every rank calls it at every log line); ``describe_metrics(dict) -> str``: their part
    of the console line. ``after_step(chunks, job, tp_rank, device)``: right after the optimizer step (applied
    or skipped), e.g. for state moved by what the step's forwards saw rather than by gradients (a
    collective: every rank calls it)."""

    before_step: Callable[[list, float], None] = lambda chunks, loss_scale: None
    after_step: Callable[..., None] = lambda chunks, job, tp_rank, device: None
    metrics: Callable[..., dict] = lambda chunks, job, tp_rank, steps, device: {}
    describe_metrics: Callable[[dict], str] = lambda metrics: ""


@dataclass(frozen=True)
class HFAdapter:
    """HuggingFace conversion of one model family (whole, layout-free tensors on both sides).

    ``model_types``: the HF ``model_type`` values it reads; ``config_from_hf(hf_config, seq_length)``
    -> the family's config; ``hf_config(cfg)`` -> the HF config dict (refusing what the format cannot
    express; the tokenizer's ``bos_token_id`` / ``eos_token_id`` are added by the writer);
    ``to_hf_state(tensors, cfg)`` / ``from_hf_state(state, cfg)`` map the tensors."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, int | None], ModelConfig]
    hf_config: Callable[[ModelConfig], dict]
    to_hf_state: Callable[[dict, ModelConfig], dict]
    from_hf_state: Callable[[dict, ModelConfig], dict]


def full_recompute_share(model_cfg: ModelConfig, parallel_cfg: ParallelConfig) -> float:
    """The default ``recomputed_share``: every layer's forward again under full recompute, else none."""
    return float(model_cfg.recompute_granularity == "full")


@dataclass(frozen=True)
class ModelSpec:
    """One model family (see the module docstring for each field)."""

    name: str
    config: type[ModelConfig]
    build_chunk: ChunkBuilder
    boundary_shape: Callable[[ModelConfig, int, ModelParallelGroups], tuple[int, ...]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_token: Callable[[ModelConfig, int, float], float]
    checkpoint_fields: tuple[str, ...] = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                          "vocab_size", "max_position_embeddings")
    describe: Callable[[ModelConfig], str] = lambda model_cfg: ""
    hooks: StepHooks = field(default_factory=StepHooks)
    hf: HFAdapter | None = None
    activation_bytes: ActivationModel | None = None
    compile_regions: Callable[[nn.Module], list[nn.Module]] | None = None
    recomputed_share: Callable[[ModelConfig, ParallelConfig], float] = full_recompute_share
    context_parallel: bool = False
    is_expert: Callable[[str], bool] = lambda name: False
    fp8_layers: Callable[[nn.Module, bool], list] | None = None
    tiny_models: tuple[tuple[str, tuple[str, ...]], ...] = ()

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
