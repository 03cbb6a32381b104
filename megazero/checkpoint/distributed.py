"""Collective save and load of a training run under any tp x pp x dp x ZeRO layout.

Who writes what (``save_checkpoint``), e.g. tp2 pp2 dp2 (8 ranks)::

    weights      dp rank 0 of each (tp, pp) position writes model_tpXX_ppYYY.safetensors: its
                 tp-local parameters (whole, inside engine.gathered_parameters()) as global slices
    optimizer    every dp rank holds pieces of the flat Adam state (ZeRO shards); they are summed
                 into dp rank 0 (each element contributed once), reshaped like the parameter and
                 written in the same file, sliced like the weight
    rng          every rank writes rng/rankNNNNN.json
    index        rank 0 merges the ranks' file lists into index.json + manifest.json

Commit protocol: all ranks write into ``DIR/.iter_0000100.tmp``; rank 0 then renames it to
``DIR/iter_0000100`` and, last, replaces ``DIR/latest_checkpointed_iteration.txt`` by an atomic
rename. A crash at any point leaves the previous tracker pointing at a complete checkpoint.

``load_checkpoint`` has every rank read exactly the global slices its parameters (and its
optimizer pieces, as whole tp-local tensors) need, whatever layout wrote them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megazero.checkpoint import format as fmt
from megazero.checkpoint.format import CheckpointError, CheckpointReader
from megazero.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megazero.optim import learning_rate
from megazero.parallel.params import attribute, counts_once, split_dim
from megazero.state import TrainState

log = logging.getLogger(__name__)
_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                 "max_position_embeddings", "untie_embeddings_and_output_weights", "activation",
                 "layernorm_epsilon")


def latest_iteration(save_dir: str | os.PathLike) -> int | None:
    """The iteration of the latest complete checkpoint under ``save_dir`` (None if there is none)."""
    return fmt.read_tracker(save_dir)


def _layout(topo, chunks, job) -> dict:
    return {"world_size": topo.world_size, "tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size,
            "virtual_stages": len(chunks), "order": job.parallel.order, "zero_stage": job.zero.zero_stage,
            "sequence_parallel": job.parallel.sequence_parallel, "dtype": job.precision.dtype_name}


def _named_params(chunks):
    """(name, param) of this rank's chunks."""
    return [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]


def _vocab(p, vocab_size: int) -> int | None:
    """The real vocabulary size for a vocabulary-padded parameter, else None (see fmt.global_region)."""
    return vocab_size if attribute(p, "vocab_padded") else None


def _agree(ok: bool, what: str, error: BaseException | None, device) -> None:
    """Raise on every rank if any rank failed (so no rank is left waiting in a collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not flag.item():
        raise CheckpointError(f"{what} failed on another rank: see that rank's error")


def _gathered(engine, write_back: bool = False):
    """engine.gathered_parameters(...), or nothing to do without an engine."""
    return contextlib.nullcontext() if engine is None else engine.gathered_parameters(write_back=write_back)


# --------------------------------------------------------------------------- optimizer pieces
def _subtract(iv: tuple[int, int], others: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of [a, b) not covered by any of ``others``."""
    parts = [iv]
    for c, d in others:
        parts = [q for a, b in parts for q in ((a, min(b, c)), (max(a, d), b)) if q[0] < q[1]]
    return parts


def _merge_optimizer_over_dp(pieces: dict, named: list, topo, keys: tuple[str, ...]) -> dict | None:
    """Whole flat tp-local optimizer tensors {name: {key: [numel]}} on dp rank 0, None elsewhere.

    Each dp rank holds pieces ``{name: {"offset", key: flat}}`` (ZeRO shards, or everything for
    stage 0). Element e of a parameter is contributed by the lowest dp rank holding it, into a
    zero buffer that is summed into dp rank 0: exact, whatever the overlap.
    """
    names = [(name, p.numel()) for name, p in named]
    meta = torch.full((len(names), 2), -1, dtype=torch.int64)
    for i, (name, _) in enumerate(names):
        if name in pieces:
            meta[i, 0], meta[i, 1] = int(pieces[name]["offset"]), pieces[name][keys[0]].numel()
    group, dp = topo.dp_group, topo.dp_size
    if dp > 1:                                   # on the device: NCCL reduces device tensors only
        meta = meta.to(topo.device)
        metas = [torch.empty_like(meta) for _ in range(dp)]
        dist.all_gather(metas, meta, group=group)
        meta, metas = meta.cpu(), [m.cpu() for m in metas]
    else:
        metas = [meta]
    me = dist.get_rank(group) if dp > 1 else 0
    starts, total = [], 0
    for _, n in names:
        starts.append(total)
        total += n
    device = next((t.device for pc in pieces.values() for t in pc.values() if torch.is_tensor(t)),
                  torch.device("cpu"))
    buf = torch.zeros(len(keys), total, dtype=torch.float32, device=device)
    for i, (name, numel) in enumerate(names):
        ivs = [(int(m[i, 0]), int(m[i, 0] + m[i, 1])) for m in metas if m[i, 0] >= 0]
        covered = sum(b - a for a, b in _subtract((0, numel), ivs))
        if covered:
            raise CheckpointError(f"optimizer state of {name!r} misses {covered} of {numel} elements across "
                                  f"the data-parallel ranks: the engine's state_dict is incomplete")
        if meta[i, 0] < 0:
            continue
        lo = int(meta[i, 0])
        lower = [(int(m[i, 0]), int(m[i, 0] + m[i, 1])) for m in metas[:me] if m[i, 0] >= 0]
        for a, b in _subtract((lo, lo + int(meta[i, 1])), lower):
            for k, key in enumerate(keys):
                buf[k, starts[i] + a:starts[i] + b] = pieces[name][key][a - lo:b - lo]
    if dp > 1:
        dist.reduce(buf, dst=dist.get_global_rank(group, 0), group=group)
    if me != 0:
        return None
    return {name: {key: buf[k, starts[i]:starts[i] + numel].cpu() for k, key in enumerate(keys)}
            for i, (name, numel) in enumerate(names)}


def _optimizer_keys(named) -> tuple[str, ...]:
    """fp32 master weights are the parameters themselves: stored only for bf16/fp16 models."""
    separate = any(p.dtype != torch.float32 for _, p in named)
    return ("exp_avg", "exp_avg_sq") + (("master",) if separate else ())


_KIND = {"exp_avg": fmt.EXP_AVG, "exp_avg_sq": fmt.EXP_AVG_SQ, "master": fmt.MASTER}


# ----------------------------------------------------------------------------------- save
def _tensor_parts(named, merged, topo, vocab_size: int) -> list:
    """[(stable name, global shape, region, tensor)] for this (tp, pp) position's file."""
    parts = []
    for name, p in named:
        if not counts_once(p, topo.tp_rank):
            continue                             # replicated over tp: tp rank 0 writes it; tied copies: never
        shape, region = fmt.global_region(p.shape, split_dim(p), topo.tp_rank, topo.tp_size, _vocab(p, vocab_size))
        parts.append((fmt.tensor_key(fmt.MODEL, name), shape, region, fmt.stored_part(p.detach(), region)))
        for key, flat in (merged or {}).get(name, {}).items():
            parts.append((fmt.tensor_key(_KIND[key], name), shape, region,
                          fmt.stored_part(flat.view(p.shape), region)))
    return parts


def _write_rank_files(tmp: Path, chunks, engine, topo, job, extra_rng) -> tuple[dict, dict | None]:
    """Write this rank's files; returns its part record and the optimizer scalars (step, scaler)."""
    named = _named_params(chunks)
    record = {"tensors": {}, "files": {}}
    opt_meta = None
    with _gathered(engine):
        merged = None
        if engine is not None:
            opt = engine.state_dict()
            opt_meta = {"step": int(opt["step"]), "loss_scaler": opt.get("loss_scaler")}
            merged = _merge_optimizer_over_dp(opt["params"], named, topo, _optimizer_keys(named))
        if topo.dp_rank == 0:
            parts = _tensor_parts(named, merged, topo, job.model.vocab_size)
            entries, files = fmt.write_tensor_file(tmp, fmt.shard_file_name(topo.tp_rank, topo.pp_rank), parts)
            record["tensors"], record["files"] = entries, files
    rng_name = f"rng/rank{topo.rank:05d}.json"
    fmt.write_json(tmp / rng_name, capture_rng_state(chunks, extra_rng))
    record["files"][rng_name] = fmt.file_record(tmp / rng_name)
    fmt.write_json(tmp / f"part_rank{topo.rank:05d}.json", record)
    return record, opt_meta


def _commit(save_dir: Path, tmp: Path, final: Path, world: int, index: dict) -> None:
    """Rank 0: merge the part files into index + manifest, rename into place, then the tracker."""
    files: dict = {}
    for r in range(world):
        part_path = tmp / f"part_rank{r:05d}.json"
        part = fmt.read_json(part_path)
        fmt.merge_entries(index["tensors"], part["tensors"])
        files.update(part["files"])
        part_path.unlink()
    fmt.commit(save_dir, tmp, final, index, files)


def _scheduler_state(iteration: int, opt_cfg) -> dict:
    """The LR schedule is a pure function of the iteration (megazero.optim.learning_rate): its
    position is the iteration; the next step's LR is recorded for people reading the index."""
    lr = learning_rate(iteration, opt_cfg) if opt_cfg.lr_decay_iters is not None else None
    return {"iteration": iteration, "next_lr": lr, "optimizer_config": dataclasses.asdict(opt_cfg)}


def save_checkpoint(save_dir, state, *, chunks, engine, topo, job, extra_rng: dict | None = None) -> Path:
    """Save weights, optimizer state, RNG states, the train state and the job config. Collective.

    ``state`` is the :class:`megazero.state.TrainState` after ``state.iteration`` steps;
    ``extra_rng``: {name: torch.Generator or object with get_states()/set_states()} saved per rank.
    Returns the checkpoint directory ``save_dir/iter_XXXXXXX``.
    """
    save_dir = Path(save_dir)
    final = save_dir / fmt.iter_dir_name(state.iteration)
    tmp = save_dir / f".{final.name}.tmp"
    error = None
    if topo.rank == 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)      # left over by a crashed save
            (tmp / "rng").mkdir(parents=True)
        except OSError as e:
            error = CheckpointError(f"cannot create {tmp} for --save: {e}")
    _agree(error is None, f"creating {tmp}", error, topo.device)
    opt_meta = None
    try:
        _, opt_meta = _write_rank_files(tmp, chunks, engine, topo, job, extra_rng)
    except Exception as e:  # noqa: BLE001 - re-raised by _agree after every rank has reported
        error = e
    _agree(error is None, f"saving {final}", error, topo.device)
    if topo.rank == 0:
        index = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "iteration": state.iteration,
                 "train_state": dataclasses.asdict(state), "optimizer": opt_meta,
                 "scheduler": _scheduler_state(state.iteration, job.optimizer),
                 "layout": _layout(topo, chunks, job), "job": job.to_dict(), "tensors": {}}
        try:
            _commit(save_dir, tmp, final, topo.world_size, index)
        except Exception as e:  # noqa: BLE001 - re-raised by _agree after every rank has reported
            error = e
    _agree(error is None, f"committing {final}", error, topo.device)
    return final


# ----------------------------------------------------------------------------------- load
def check_model_compatible(saved_model: dict, model_cfg, where) -> None:
    """Refuse a checkpoint whose model differs in a way that changes shapes or meaning."""
    for name in _MODEL_FIELDS:
        mine, theirs = getattr(model_cfg, name), saved_model.get(name)
        if mine != theirs:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(f"{where} was saved with {flag} {theirs}, this run has {mine}: "
                                  f"use the checkpoint's model settings")


def _read_rank(reader: CheckpointReader, named, topo, job, weights_only: bool) -> dict | None:
    """Copy this rank's weights into the parameters; return the optimizer state to load (or None)."""
    opt_pieces = {}
    with torch.no_grad():
        for name, p in named:
            vocab = _vocab(p, job.model.vocab_size)
            local = reader.read_local(fmt.tensor_key(fmt.MODEL, name), p.shape, split_dim(p),
                                      topo.tp_rank, topo.tp_size, vocab, p.dtype)
            p.copy_(local)
            if weights_only:
                continue
            piece = {"offset": 0}
            for key, kind in _KIND.items():
                stored = kind if key != "master" or reader.has(fmt.tensor_key(kind, name)) else fmt.MODEL
                piece[key] = reader.read_local(fmt.tensor_key(stored, name), p.shape, split_dim(p),
                                               topo.tp_rank, topo.tp_size, vocab, torch.float32).view(-1)
            opt_pieces[name] = piece
    if weights_only:
        return None
    meta = reader.index["optimizer"]
    return {"step": meta["step"], "loss_scaler": meta.get("loss_scaler"), "params": opt_pieces}


def load_checkpoint(load_dir, *, chunks, engine, topo, job, weights_only: bool = False,
                    iteration: int | None = None, extra_rng: dict | None = None):
    """Load the latest (or ``iteration``'s) checkpoint under ``load_dir`` into this layout. Collective.

    Returns the :class:`megazero.state.TrainState` to continue from (a fresh one with
    ``weights_only``: weights only, no optimizer state, iteration 0), or None when ``load_dir`` holds
    no checkpoint (no tracker file) -- the caller decides whether that is an error.
    """
    load_dir = Path(load_dir)
    iteration = latest_iteration(load_dir) if iteration is None else iteration
    if iteration is None:
        return None
    directory = load_dir / fmt.iter_dir_name(iteration)
    error, reader, opt_state = None, None, None
    try:
        reader = CheckpointReader(directory)
        check_model_compatible(reader.index["job"]["model"], job.model, directory)
        if not weights_only and reader.index.get("optimizer") is None:
            raise CheckpointError(f"{directory} holds weights only (no optimizer state): load it with "
                                  f"--finetune (weights only, iteration 0)")
        named = _named_params(chunks)
        with _gathered(engine, write_back=True):
            opt_state = _read_rank(reader, named, topo, job, weights_only)
    except Exception as e:  # noqa: BLE001 - re-raised by _agree after every rank has reported
        error = e
    _agree(error is None, f"loading {directory}", error, topo.device)
    if weights_only:
        return TrainState()
    if engine is not None:
        engine.load_state_dict(opt_state)
    _restore_rng(reader, chunks, topo, job, extra_rng, directory)
    return TrainState(**reader.index["train_state"])


def _restore_rng(reader, chunks, topo, job, extra_rng, directory) -> None:
    saved, mine = reader.index["layout"], _layout(topo, chunks, job)
    keys = ("world_size", "tp", "pp", "dp", "virtual_stages", "order")
    if any(saved[k] != mine[k] for k in keys):
        if topo.rank == 0:
            log.warning("%s was saved under tp %s pp %s dp %s; this run is tp %s pp %s dp %s: random states "
                        "(dropout) start fresh from the seed", directory, saved["tp"], saved["pp"], saved["dp"],
                        mine["tp"], mine["pp"], mine["dp"])
        return
    restore_rng_state(reader.read_json_file(f"rng/rank{topo.rank:05d}.json"), chunks, extra_rng)
