"""The registry of model families, found by name (``--model-family``), and the chunks of this rank.

    register_model_spec(ModelSpec(name="softcap", config=SoftcapConfig, ...))   # a family of one's own
    spec = get_model_spec(job.model.model_family)
    chunks = build_model_chunks(spec, job, topo)              # this rank's pipeline chunks

Registering a spec registers its config class with the configuration
(:func:`megazero.config.model.register_family`), which is where the names live: built-in families are
imported the first time they are named, so importing this module imports no model.
"""
from __future__ import annotations

import torch
from torch import nn

from megazero.config import JobConfig
from megazero.config.model import Family, family, register_family, registered_families
from megazero.errors import ConfigError
from megazero.parallel import fp8
from megazero.parallel.pipeline.generators import stage_shape
from megazero.parallel.pipeline.partition import placements
from megazero.spec.model_spec import ModelSpec


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Make ``spec`` findable by ``spec.name`` (``--model-family``), its config class parsed, built and
    checked with it; returns it. Registering a name again replaces the earlier spec (a test
    re-registering its model in a reused worker process)."""
    register_family(Family(spec.name, spec.config, context_parallel=spec.context_parallel,
                           compilable=spec.compile_regions is not None, fp8=spec.fp8_layers is not None, spec=spec))
    return spec


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; a ConfigError naming ``--model-family`` and the known names."""
    return family(name).spec


def spec_for_hf(model_type: str) -> ModelSpec:
    """The spec whose HF adapter reads ``model_type`` (GPT-2 when absent from an HF config)."""
    specs = [entry.spec for entry in registered_families()]
    for spec in specs:
        if spec.hf is not None and model_type in spec.hf.model_types:
            return spec
    known = sorted(t for s in specs if s.hf is not None for t in s.hf.model_types)
    raise ConfigError(f"cannot import this HF model: model_type {model_type!r} (megazero reads {', '.join(known)})")


def build_model_chunks(spec: ModelSpec, job: JobConfig, topo, *, dtype: torch.dtype = torch.float32,
                       device=None) -> list[nn.Module]:
    """This rank's ``v`` chunks (``v = job.parallel.virtual_stages``; 1 unless interleaved or zb-v), chunk c
    being virtual stage ``c * pp + pp_rank`` (in the V of zb-v, odd chunks ``c * pp + pp - 1 - pp_rank``:
    :func:`megazero.parallel.pipeline.partition.placements`). ``job`` is validated
    (:func:`megazero.config.validate`) for ``topo``'s world.
    ``device="meta"`` allocates nothing (the ZeRO engine then materialises each parameter where it
    lives, from the chunk's ``initial_value``)."""
    par = job.parallel
    assert (par.tp, par.cp, par.pp) == (topo.tp_size, topo.cp_size, topo.pp_size), \
        "build the topology and the chunks from the same validated job"
    groups = topo.model_groups(par.sequence_parallel, par.cp_comm_type)
    chunks = [spec.build_chunk(job.model, placement, groups, seed=job.train.seed, dtype=dtype,
                             device=device if device is not None else topo.device, home_device=topo.device)
            for placement in placements(job.model.num_layers, topo.pp_size, topo.pp_rank, par.virtual_stages,
                                        stage_shape(par))]
    if job.fp8.enabled:                                # --fp8-format: the declared linears, in FP8
        for chunk in chunks:
            fp8.enable(chunk, spec.fp8_layers(chunk, job.fp8.fp8_head), job.fp8)
    return chunks
