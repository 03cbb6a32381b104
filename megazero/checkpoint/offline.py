"""Single-process access to checkpoints for tools: whole tensors by stable name, no process group.

    cfg, tensors, index = read_model(path)          # path: a save dir (tracker) or an iter_* dir
    model = build_full_model(path)                  # a tp=1 GPT with the checkpoint's weights
    write_weights_checkpoint(out_dir, tensors, job, tp=2, pp=2)   # files sharded for that layout

Whole tensors here are the layout-free form of :mod:`megazero.checkpoint.format`: the tp=1 shape,
with exactly ``vocab_size`` rows for the word embedding and untied output layer.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

from megazero.checkpoint import format as fmt
from megazero.checkpoint.format import CheckpointError, CheckpointReader
from megazero.config import (CheckpointConfig, DataConfig, JobConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainConfig, ZeroConfig)

# Which dim of the full tensor tensor parallelism splits (mirrors the layers in megazero/models/gpt.py;
# tests/test_checkpoint.py checks it against a real GPT's ``partition_dim`` attributes).
_SPLIT_DIM0 = ("attention.qkv.weight", "attention.qkv.bias", "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
               "embedding.word_embeddings.weight", "output_layer.weight")
_SPLIT_DIM1 = ("attention.dense.weight", "mlp.dense_4h_to_h.weight")


def partition_dim_of(name: str) -> int:
    """The tensor-parallel split dim of parameter ``name`` (-1: replicated)."""
    if name.endswith(_SPLIT_DIM0):
        return 0
    if name.endswith(_SPLIT_DIM1):
        return 1
    return -1


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint (has an index), else the latest one under it."""
    path = Path(path)
    if (path / fmt.MANIFEST).is_file():
        return path
    iteration = fmt.read_tracker(path)
    if iteration is None:
        raise CheckpointError(f"{path} is neither a checkpoint directory (no {fmt.MANIFEST}) nor a save "
                              f"directory (no {fmt.TRACKER}): pass --save's directory or an iter_* directory")
    return path / fmt.iter_dir_name(iteration)


_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "zero": ZeroConfig, "precision": PrecisionConfig,
             "optimizer": OptimizerConfig, "data": DataConfig, "train": TrainConfig,
             "checkpoint": CheckpointConfig, "logging": LoggingConfig}


def job_from_dict(d: dict) -> JobConfig:
    """The JobConfig saved in an index (unknown keys, e.g. from a newer version, are dropped)."""
    kw = {}
    for name, cls in _SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        kw[name] = cls(**{k: v for k, v in d.get(name, {}).items() if k in known})
    return JobConfig(**kw)


def read_model(path: str | os.PathLike, verify: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, {parameter name: whole tensor}, index) of a checkpoint."""
    reader = CheckpointReader(resolve(path), verify=verify)
    job = job_from_dict(reader.index["job"])
    tensors = {name: reader.read_full(fmt.tensor_key(fmt.MODEL, name)) for name in reader.names(fmt.MODEL)}
    return job.model, tensors, reader.index


def build_full_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device=None):
    """A single-process (tp=1, all layers) GPT holding a checkpoint's weights, in eval mode."""
    from megazero.models.gpt import GPT

    reader = CheckpointReader(resolve(path))
    job = job_from_dict(reader.index["job"])
    model = GPT(job.model, dtype=dtype, device=device or "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.read_local(fmt.tensor_key(fmt.MODEL, name), p.shape, p.partition_dim, 0, 1,
                                      job.model.vocab_size, p.dtype))
    return model.eval(), job


def _stage_of(name: str, cfg: ModelConfig, pp: int) -> list[int]:
    """Pipeline ranks (v = 1) whose file holds parameter ``name``."""
    if name.startswith("layers."):
        return [int(name.split(".")[1]) * pp // cfg.num_layers]
    if name.startswith("embedding."):
        return [0]
    return [pp - 1]                               # final_norm, output_layer


def write_weights_checkpoint(save_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], job: JobConfig,
                             *, tp: int = 1, pp: int = 1, iteration: int = 0) -> Path:
    """Write whole tensors as a weights-only checkpoint whose files are split for a tp x pp layout
    (any layout can still load it). Crash-safe like the trainer's save. Returns the iter directory."""
    cfg = job.model
    job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, tp=tp, pp=pp, dp=1))
    save_dir = Path(save_dir)
    final = save_dir / fmt.iter_dir_name(iteration)
    tmp = save_dir / f".{final.name}.tmp"
    save_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    index = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "iteration": iteration,
             "train_state": {"iteration": iteration, "consumed_samples": 0, "skipped_iterations": 0},
             "optimizer": None, "scheduler": None, "job": job.to_dict(), "tensors": {},
             "layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "dp": 1, "virtual_stages": 1,
                        "order": job.parallel.order, "zero_stage": None, "sequence_parallel": False,
                        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch.")}}
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            parts = []
            for name, full in tensors.items():
                if pp_rank not in _stage_of(name, cfg, pp):
                    continue
                pdim = partition_dim_of(name)
                if pdim < 0 and tp_rank != 0:
                    continue                     # replicated over tp: written once
                local = _local_slice(name, full, pdim, tp_rank, tp, cfg)
                shape, region = fmt.global_region(name, local.shape, pdim, tp_rank, tp, cfg.vocab_size)
                parts.append((fmt.tensor_key(fmt.MODEL, name), shape, region, fmt.stored_part(local, region)))
            entries, written = fmt.write_tensor_file(tmp, fmt.shard_file_name(tp_rank, pp_rank), parts)
            fmt.merge_entries(index["tensors"], entries)
            files.update(written)
    fmt.commit(save_dir, tmp, final, index, files)
    return final


def _local_slice(name: str, full: torch.Tensor, pdim: int, tp_rank: int, tp: int, cfg: ModelConfig) -> torch.Tensor:
    """tp rank ``tp_rank``'s tensor, vocab padded to the tp-dependent size first."""
    if name in fmt.VOCAB_PARAMS:
        if full.shape[0] != cfg.vocab_size:
            raise CheckpointError(f"{name} has {full.shape[0]} rows, expected vocab_size {cfg.vocab_size}")
        padded = torch.zeros((cfg.padded_vocab_size(tp),) + tuple(full.shape[1:]), dtype=full.dtype)
        padded[:cfg.vocab_size] = full
        full = padded
    if pdim < 0 or tp == 1:
        return full
    return full.chunk(tp, dim=pdim)[tp_rank]
