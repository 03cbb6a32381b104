"""Single-process access to checkpoints for tools: whole tensors by stable name, no process group.

    cfg, tensors, index = read_model(path)          # path: a save dir (tracker) or an iter_* dir
    model, job = build_full_model(path)             # a tp=1 model (its spec's) with the checkpoint's weights
    write_weights_checkpoint(out_dir, tensors, job, tp=2, pp=2)   # files sharded for that layout

Whole tensors here are the layout-free form of :mod:`megazero.checkpoint.format`: the tp=1 shape,
with exactly ``vocab_size`` rows for the word embedding and untied output layer. They include the
model's persistent buffers (state that is not a parameter, e.g. an MoE router's expert bias), stored
whole under ``model.buffer/<name>`` as the trainer saves them.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

from megazero.checkpoint import format as fmt
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.regions import numel
from megazero.checkpoint.tensor_file import write_pieces
from megazero.config import FLAG, JobConfig, ModelConfig
from megazero.errors import CheckpointError
from megazero.parallel.params import attribute, counts_once, split_dim
from megazero.spec import get_model_spec


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    """What the model declares about one parameter, read without a process group (meta device)."""

    partition_dim: int          # the tensor-parallel split dim, -1: replicated
    vocab_padded: bool          # dim 0 is the padded vocabulary
    stages: tuple[int, ...]     # the pipeline ranks (v = 1) whose file holds it
    shape: tuple[int, ...] = ()  # the whole tensor's shape (vocab_size rows where vocab_padded)


def declarations(cfg: ModelConfig, pp: int = 1) -> dict[str, ParamDecl]:
    """Every saved parameter of the model, by name: built on the meta device for each pipeline rank
    (no memory), so split dims, vocabulary padding and stage membership are the model's own."""
    out: dict[str, ParamDecl] = {}
    spec = get_model_spec(cfg.model_family)
    for r in range(pp):
        chunk, = spec.meta_chunks(cfg, pp, r)
        for name, p in chunk.named_parameters():
            if not counts_once(p, 0):
                continue                               # a tied copy: its original is saved
            decl = out.get(name)
            stages = (decl.stages if decl else ()) + (r,)
            padded = bool(attribute(p, "vocab_padded"))
            shape = ((cfg.vocab_size,) + tuple(p.shape[1:])) if padded else tuple(p.shape)
            out[name] = ParamDecl(split_dim(p), padded, stages, shape)
    return out


def buffer_declarations(cfg: ModelConfig, pp: int = 1) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Every persistent buffer of the model, by name: (the first pipeline rank (v = 1) whose chunk holds it,
    its shape), from a meta build of each rank's chunk."""
    out: dict[str, tuple[int, tuple[int, ...]]] = {}
    spec = get_model_spec(cfg.model_family)
    for r in range(pp):
        chunk, = spec.meta_chunks(cfg, pp, r)
        parameters = {name for name, _ in chunk.named_parameters()}
        for name, t in chunk.state_dict(keep_vars=True).items():
            if name not in parameters and name not in out:
                out[name] = (r, tuple(t.shape))
    return out


def check_shapes(tensors: dict[str, torch.Tensor], cfg: ModelConfig, decls: dict[str, ParamDecl] | None = None,
                 source: str = "the weights") -> None:
    """Every tensor has the whole shape the model config declares for it, or :class:`CheckpointError`
    naming the first that does not (a config that disagrees with its weights is refused before
    anything is written)."""
    decls = decls if decls is not None else declarations(cfg)
    for name, tensor in tensors.items():
        want = decls[name].shape if name in decls else None
        if want and tuple(tensor.shape) != want:
            raise CheckpointError(f"{source}: {name} is {list(tensor.shape)} but the config (hidden_size "
                                  f"{cfg.hidden_size}, ffn_hidden_size {cfg.ffn_hidden_size}, vocab_size "
                                  f"{cfg.vocab_size}, {cfg.num_layers} layers) needs {list(want)}: the config "
                                  f"does not describe these weights")


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint (has an index), else the latest one under it."""
    path = Path(path)
    if (path / fmt.MANIFEST).is_file():
        return path
    iteration = fmt.read_tracker(path)
    if iteration is None:
        raise CheckpointError(f"{path} is neither a checkpoint directory (no {fmt.MANIFEST}) nor a save "
                              f"directory (no {fmt.TRACKER}): pass {FLAG.save}'s directory or an iter_* directory")
    return fmt.checkpoint_dir(path, iteration)


def saved_job(index: dict) -> JobConfig:
    """The JobConfig saved in a checkpoint's index (unknown keys, e.g. from a newer version, dropped)."""
    return JobConfig.from_dict(index["job"], strict=False)


def read_model(path: str | os.PathLike, verify: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, {parameter or persistent buffer name: whole tensor}, index) of a checkpoint."""
    reader = CheckpointReader(resolve(path), verify=verify)
    job = saved_job(reader.index)
    tensors = {name: reader.read_full(fmt.tensor_key(kind, name))
               for kind in (fmt.MODEL, fmt.MODEL_BUFFER) for name in reader.names(kind)}
    return job.model, tensors, reader.index


def check_index_shapes(reader: CheckpointReader) -> int:
    """Every model tensor the index lists has the whole shape the checkpoint's own model config
    declares (and every declared parameter is there). Returns the tensors checked."""
    cfg = saved_job(reader.index).model
    decls = declarations(cfg)
    names = reader.names(fmt.MODEL)
    missing = sorted(set(decls) - set(names))
    if missing:
        raise CheckpointError(f"{reader.dir / fmt.INDEX} lacks {missing[:5]} of its model config's parameters: "
                              f"the index does not describe this model")
    shapes = {name: torch.empty(reader.shape(fmt.tensor_key(fmt.MODEL, name)), device="meta") for name in names}
    check_shapes(shapes, cfg, decls, source=f"{reader.dir / fmt.INDEX}")
    return len(names)


def build_full_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device=None):
    """(a single-process (tp=1, all layers) model of the checkpoint's family holding its weights, in eval
    mode; the checkpoint's job)."""
    reader = CheckpointReader(resolve(path))
    job = saved_job(reader.index)
    model = get_model_spec(job.model.model_family).build_full(job.model, dtype=dtype, device=device or "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            vocab = job.model.vocab_size if attribute(p, "vocab_padded") else None
            p.copy_(reader.read_local(fmt.tensor_key(fmt.MODEL, name), p.shape, split_dim(p), 0, 1, vocab, p.dtype))
        for name, buffer in model.named_buffers():          # persistent model state (an MoE expert bias)
            key = fmt.tensor_key(fmt.MODEL_BUFFER, name)
            if reader.has(key):
                buffer.copy_(reader.read_full(key, buffer.dtype).view(buffer.shape))
    return model.eval(), job


def write_weights_checkpoint(save_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], job: JobConfig,
                             *, tp: int = 1, pp: int = 1, iteration: int = 0) -> Path:
    """Write whole tensors (parameters, and persistent buffers as ``model.buffer/<name>``) as a weights-only
    checkpoint whose files are split for a tp x pp layout (any layout can still load it); a buffer is written
    whole, by tp rank 0 of the first stage holding it, as the trainer writes it. Crash-safe like the trainer's
    save. Returns the iter directory."""
    cfg = job.model
    job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, tp=tp, pp=pp, dp=1))
    save_dir = Path(save_dir)
    final = save_dir / fmt.iter_dir_name(iteration)
    tmp = save_dir / f".{final.name}.tmp"
    decls, buffers = declarations(cfg, pp), buffer_declarations(cfg, pp)
    unknown = sorted(set(tensors) - set(decls) - set(buffers))
    if unknown:
        raise CheckpointError(f"tensors {unknown[:5]} are not parameters or buffers of a {cfg.num_layers}-layer "
                              f"{cfg.model_family} model")
    check_shapes(tensors, cfg, decls)                 # before anything is written
    for name, (_, shape) in buffers.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"buffer {name} is {list(tensors[name].shape)} but the config needs {list(shape)}: "
                                  f"the config does not describe these tensors")
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return _write_weights(save_dir, tmp, final, tensors, job, decls, buffers, tp, pp, iteration)
    except OSError as e:                          # a full disk, a vanished mount: one line, no .tmp left
        raise fmt.write_failed(e, tmp, final) from None


def _write_weights(save_dir: Path, tmp: Path, final: Path, tensors: dict[str, torch.Tensor], job: JobConfig,
                   decls: dict[str, ParamDecl], buffers: dict[str, tuple[int, tuple[int, ...]]], tp: int, pp: int,
                   iteration: int) -> Path:
    cfg = job.model
    dtype = next((t.dtype for name, t in tensors.items() if name in decls), next(iter(tensors.values())).dtype)
    index = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "iteration": iteration,
             "train_state": {"iteration": iteration, "consumed_samples": 0, "skipped_iterations": 0},
             "optimizer": None, "scheduler": None, "job": job.to_dict(), "tensors": {},
             "layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "dp": 1, "virtual_stages": 1,
                        "order": job.parallel.order, "zero_stage": None, "sequence_parallel": False,
                        "dtype": str(dtype).removeprefix("torch.")}}
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            pieces = []
            for name, full in tensors.items():
                if name in buffers:
                    if buffers[name][0] == pp_rank and tp_rank == 0:
                        pieces.append((fmt.tensor_key(fmt.MODEL_BUFFER, name), list(full.shape),
                                       [[0, n] for n in full.shape], (0, full.numel()), full.reshape(-1)))
                    continue
                decl = decls[name]
                if pp_rank != decl.stages[0] or (decl.partition_dim < 0 and tp_rank != 0):
                    continue                     # another stage's, or replicated over tp: written once
                local = _local_slice(name, full, decl, tp_rank, tp, cfg)
                vocab = cfg.vocab_size if decl.vocab_padded else None
                shape, box = fmt.global_region(local.shape, decl.partition_dim, tp_rank, tp, vocab)
                pieces.append((fmt.tensor_key(fmt.MODEL, name), shape, box, (0, numel(box)),
                               local.reshape(-1)[:numel(box)]))
            file = tmp / fmt.rank_file_name(pp_rank * tp + tp_rank)
            entries, written = write_pieces(file, pieces, {"format": fmt.FORMAT_NAME})
            fmt.merge_entries(index["tensors"], entries)
            files.update(written)
    fmt.commit(save_dir, tmp, final, index, files)
    return final


def _local_slice(name: str, full: torch.Tensor, decl: ParamDecl, tp_rank: int, tp: int,
                 cfg: ModelConfig) -> torch.Tensor:
    """tp rank ``tp_rank``'s tensor, vocab padded to the tp-dependent size first."""
    pdim = decl.partition_dim
    if decl.vocab_padded:
        if full.shape[0] != cfg.vocab_size:
            raise CheckpointError(f"{name} has {full.shape[0]} rows, expected vocab_size {cfg.vocab_size}")
        padded = torch.zeros((cfg.padded_vocab_size(tp),) + tuple(full.shape[1:]), dtype=full.dtype)
        padded[:cfg.vocab_size] = full
        full = padded
    if pdim < 0 or tp == 1:
        return full
    return full.chunk(tp, dim=pdim)[tp_rank]
