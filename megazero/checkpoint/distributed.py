"""Collective save and load of a training run under any tp x pp x dp x ZeRO layout, each rank touching
only what it owns (the format: :mod:`megazero.checkpoint.format`).

Who writes what (``save_checkpoint``), e.g. tp2 pp2 dp2 ZeRO-3 (8 ranks)::

    tensors   every rank writes rankNNNNN.safetensors: for every ZeRO bucket of its chunks, its dp shard
              of the elements -- weights, fp32 masters (bf16/fp16), Adam moments -- of the parameters
              it counts once (a tensor-parallel shard on every tp rank, a replicated one on tp rank 0,
              never a tied copy); all ranks in parallel, nothing gathered, nothing merged
              (FP8 delayed scaling: each linear's amax history, whole, by the tp rank 0 of its data-parallel
              rank 0 -- the history is agreed over every rank holding the layer)
    rng       every rank writes rng/rankNNNNN.json
    index     rank 0 merges the ranks' part records into index.json + manifest.json

Commit protocol: all ranks write into ``DIR/.iter_0000100.tmp``; rank 0 then renames it to
``DIR/iter_0000100`` and, last, replaces ``DIR/latest_checkpointed_iteration.txt`` by an atomic
rename. A crash at any point leaves the previous tracker pointing at a complete checkpoint.

``load_checkpoint`` has every rank read, from every stored piece, only the elements it will hold
(:meth:`megazero.parallel.zero.ZeroEngine.loaded_pieces`): its weights (whole tp-local parameters,
or its ZeRO-3 shard) and the optimizer state it owns, whatever layout wrote them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megazero.checkpoint import format as fmt
from megazero.checkpoint.agree import raise_first_error
from megazero.checkpoint.finite import describe, first_nonfinite, first_over_ranks, listed, nonfinite_names
from megazero.checkpoint.lock import SaveDirectoryLost, SaveLock, directory_lost
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.regions import numel
from megazero.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megazero.checkpoint.tensor_file import write_pieces
from megazero.config import FLAG, ModelConfig, flag
from megazero.config.optimizer import OPTIMIZERS
from megazero.errors import CheckpointError, ConfigError
from megazero.lr_schedule import learning_rate
from megazero.parallel import fp8
from megazero.parallel.params import attribute, counts_once, split_dim
from megazero.parallel.zero import StatePiece
from megazero.ranks import parse_order
from megazero.spec import get_model_spec
from megazero.state import TrainState

log = logging.getLogger(__name__)
_KIND = {"model": fmt.MODEL, "exp_avg": fmt.EXP_AVG, "exp_avg_sq": fmt.EXP_AVG_SQ, "master": fmt.MASTER}


def latest_iteration(save_dir: str | os.PathLike) -> int | None:
    """The iteration of the latest complete checkpoint under ``save_dir`` (None if there is none)."""
    return fmt.read_tracker(save_dir)


def _layout(topo, chunks, job) -> dict:
    return {"world_size": topo.world_size, "tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size,
            "cp": topo.cp_size, "virtual_stages": len(chunks), "order": _canonical_order(job.parallel.order),
            "zero_stage": job.zero.zero_stage,
            "sequence_parallel": job.parallel.sequence_parallel, "dtype": job.precision.dtype_name}


def _canonical_order(order: str) -> str:
    """The rank order with cp named (``tp-dp-pp`` and ``tp-cp-dp-pp`` are the same layout)."""
    return "-".join(parse_order(order))


def _where(piece: StatePiece, topo, vocab_size: int) -> tuple[list[int], list[list[int]], tuple[int, int]]:
    """(global shape, box, flat range in the box) of a piece: its tp-local region, and its element
    range cut to the real rows of a vocabulary-padded parameter (the padding is not stored)."""
    vocab = vocab_size if attribute(piece.param, "vocab_padded") else None
    shape, box = fmt.global_region(piece.shape, split_dim(piece.param), topo.tp_rank, topo.tp_size, vocab)
    return shape, box, (piece.lo, min(piece.hi, numel(box)))


def _whole_params(chunks) -> list[StatePiece]:
    """The weights of chunks without a ZeRO engine (tools loading a model): every parameter whole."""
    return [StatePiece(name, p, p.shape, 0, p.numel(), {"model": p.data.view(-1)})
            for chunk in chunks for name, p in chunk.named_parameters()]


def _agree(ok: bool, what: str, error: BaseException | None, device, group=None) -> None:
    """Raise on every rank if any rank failed (so no rank is left waiting in a collective); the other
    ranks' error names the first failing rank and its error's first line."""
    text = None if ok else (str(error).splitlines() or [type(error).__name__])[0] if error else what
    first = first_over_ranks(text, device, group)
    if error is not None:
        raise error
    if first is not None:
        raise CheckpointError(f"{what} failed on another rank: {first}")


def rank_pieces(chunks, engine, topo, job) -> list[tuple]:
    """This rank's pieces, ``[(key, global shape, box, (a, b), 1-D tensor)]``, views of the live tensors:
    for every ZeRO bucket its dp shard of the weights, fp32 masters and Adam moments of the parameters
    it counts once (see the module docstring)."""
    pieces = []
    for piece in engine.saved_pieces() if engine is not None else _whole_params(chunks):
        if not counts_once(piece.param, topo.tp_rank):
            continue
        shape, box, (a, b) = _where(piece, topo, job.model.vocab_size)
        if a < b:
            pieces += [(fmt.tensor_key(_KIND[kind], piece.name), shape, box, (a, b), view[:b - a])
                       for kind, view in piece.tensors.items()]
    return pieces + fp8_history_pieces(chunks, topo) + buffer_pieces(chunks, topo)


def persistent_buffers(chunks) -> dict[str, torch.Tensor]:
    """The chunks' persistent buffers by name (the same names on every layout): model state that is not
    a parameter, e.g. an MoE router's expert bias."""
    out = {}
    for chunk in chunks or []:
        for name, buffer in chunk.named_buffers():
            owner, _, attr = name.rpartition(".")
            if attr not in chunk.get_submodule(owner)._non_persistent_buffers_set:
                out[name] = buffer
    return out


def buffer_pieces(chunks, topo) -> list[tuple]:
    """The persistent buffers this rank writes, whole: a buffer is the same on every rank holding its
    module (tp x dp x cp), so tp rank 0 of data-parallel rank 0 of each pipeline stage writes its chunks'."""
    if topo.tp_rank != 0 or topo.data_context_parallel().rank != 0:
        return []
    return [(fmt.tensor_key(fmt.MODEL_BUFFER, name), list(b.shape), [[0, n] for n in b.shape], (0, b.numel()),
             b.reshape(-1)) for name, b in persistent_buffers(chunks).items()]


def fp8_history_pieces(chunks, topo) -> list[tuple]:
    """The FP8 delayed recipe's amax histories this rank writes, as pieces of whole [3, history] tensors.
    A history is agreed over every rank holding its linear (tp x dp x cp; for experts tp x expert data
    parallel), so it is written once: by tp rank 0 of that group's data-parallel rank 0."""
    if not chunks or topo.tp_rank != 0 or not fp8.history_state(chunks):
        return []
    first = {False: topo.data_context_parallel().rank == 0, True: topo.expert_data_parallel().rank == 0}
    pieces = []
    for expert in (False, True):
        for name, history in (fp8.history_state(chunks, expert) if first[expert] else {}).items():
            shape = list(history.shape)
            pieces.append((fmt.tensor_key(fmt.FP8_HISTORY, name), shape, [[0, n] for n in shape],
                           (0, history.numel()), history.reshape(-1)))
    return pieces


def first_nonfinite_weight(engine, topo, job) -> str | None:
    """The first parameter whose weights (in the run's precision) hold a non-finite value, over all
    ranks in rank order, as :func:`megazero.checkpoint.finite.describe` names it; None when all are
    finite. A collective: what a run that stops after an fp16/bf16 overflow names."""
    weights = [p for p in rank_pieces(None, engine, topo, job) if p[0].startswith(fmt.MODEL + "/")]
    return first_over_ranks(first_nonfinite(weights), topo.device)


@dataclass
class SavePlan:
    """Everything one rank's part of a save writes, fixed at the save step: its pieces (views of the
    live tensors, or host copies that training may not touch), its RNG states and, on rank 0, the
    index fields. :func:`write_planned` writes and commits it, now or in a background thread."""
    save_dir: Path
    final: Path
    rank: int
    world_size: int
    pieces: list[tuple]
    rng: dict
    index: dict | None

    @property
    def tmp(self) -> Path:
        return self.save_dir / f".{self.final.name}.tmp"

    @property
    def snapshot_tensors(self) -> list[torch.Tensor]:
        """The pieces' tensors (host copies, once written reusable by the next snapshot)."""
        return [p[4] for p in self.pieces]


class NonFiniteState(CheckpointError):
    """A save refused because what it would write holds a non-finite value (the run stops)."""


def _copy_to_host(pieces: list[tuple], buffers: list[torch.Tensor] | None) -> list[tuple]:
    """The pieces with their tensors copied to host memory: into ``buffers`` (a previous snapshot's)
    when they match piece by piece, which spares the page faults of fresh memory (7x faster on a CPU,
    where freed memory goes back to the system), else into new (on a GPU, pinned) tensors."""
    reuse = buffers is not None and len(buffers) == len(pieces) and all(
        b.dtype == p[4].dtype and b.numel() == p[4].numel() for b, p in zip(buffers, pieces))
    out, on_gpu = [], False
    for i, (key, shape, box, ab, t) in enumerate(pieces):
        on_gpu |= t.is_cuda
        host = buffers[i] if reuse else torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t.detach(), non_blocking=t.is_cuda)
        out.append((key, shape, box, ab, host))
    if on_gpu:
        torch.cuda.synchronize()
    return out


def plan_save(save_dir, state, *, chunks, engine, topo, job, extra_rng: dict | None = None,
              snapshot: bool = False, buffers: list[torch.Tensor] | None = None) -> SavePlan:
    """What this rank's part of the save of ``state`` is, after checking it is finite. Collective.

    ``snapshot``: copy the pieces to host memory (training may then change the live tensors while
    they are written), into ``buffers`` (an earlier plan's ``snapshot_tensors``) when they fit. Any
    non-finite value on any rank -- weights in any precision, fp32 masters, Adam moments -- raises
    :class:`NonFiniteState` on every rank, naming the first one (rank order), before anything is
    written: the previous latest checkpoint stays."""
    save_dir = Path(save_dir)
    final = save_dir / fmt.iter_dir_name(state.iteration)
    pieces = rank_pieces(chunks, engine, topo, job)
    if snapshot:
        pieces = _copy_to_host(pieces, buffers)
    bad = first_over_ranks(first_nonfinite(pieces), topo.device)
    if bad is not None:
        latest = fmt.read_tracker(save_dir)
        kept = f"{fmt.iter_dir_name(latest)} stays the latest" if latest is not None else "none was saved before"
        raise NonFiniteState(f"iteration {state.iteration}: {bad} is not finite: checkpoint {final.name} is not "
                             f"written ({kept}) and the run stops. Lower {FLAG.lr} or check the data")
    index = None
    if topo.rank == 0:
        opt = engine.optimizer if engine is not None else None
        opt_meta = None if opt is None else {"name": OPTIMIZERS[job.optimizer.optimizer], "step": opt.step_count,
                                             "loss_scaler": opt.scaler.state_dict() if opt.scaler else None}
        index = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "iteration": state.iteration,
                 "train_state": dataclasses.asdict(state), "optimizer": opt_meta,
                 "scheduler": _scheduler_state(state.iteration, job.optimizer),
                 "layout": _layout(topo, chunks, job), "job": job.to_dict(), "tensors": {}}
    return SavePlan(save_dir, final, topo.rank, topo.world_size, pieces, capture_rng_state(chunks, extra_rng), index)


def _write_rank_files(plan: SavePlan) -> None:
    """Write this rank's tensor file (its pieces), RNG file and part record into the temporary directory."""
    tmp = plan.tmp
    entries, files = write_pieces(tmp / fmt.rank_file_name(plan.rank), plan.pieces, {"format": fmt.FORMAT_NAME})
    rng_name = f"rng/rank{plan.rank:05d}.json"
    fmt.write_json(tmp / rng_name, plan.rng)
    files[rng_name] = fmt.file_record(tmp / rng_name)
    fmt.write_json(tmp / f"part_rank{plan.rank:05d}.json", {"tensors": entries, "files": files})


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
    """The LR schedule is a pure function of the iteration (megazero.lr_schedule.learning_rate): its
    position is the iteration; the next step's LR is recorded for people reading the index."""
    lr = learning_rate(iteration, opt_cfg) if opt_cfg.lr_decay_iters is not None else None
    return {"iteration": iteration, "next_lr": lr, "optimizer_config": dataclasses.asdict(opt_cfg)}


def write_planned(plan: SavePlan, device, group=None, lock: SaveLock | None = None) -> Path:
    """Write and commit a planned save (the module docstring's protocol). Collective over ``group``
    (default: the world); ``device``: where that group's tensors live. Returns the checkpoint directory.

    ``lock`` (rank 0's ``--save`` lock) is checked before anything is written and again before the
    commit: a directory deleted or replaced under the run raises :class:`SaveDirectoryLost` on rank 0
    (and the agreed error on the others), writing nothing more there. Any other failure removes the
    temporary directory (rank 0, once every rank has stopped writing)."""
    try:
        return _write_and_commit(plan, device, group, lock)
    except Exception as e:
        if plan.rank == 0 and not isinstance(e, SaveDirectoryLost):
            shutil.rmtree(plan.tmp, ignore_errors=True)
        raise


def _lost(lock: SaveLock | None, final: Path) -> SaveDirectoryLost | None:
    """The error of a ``--save`` directory that is no longer this run's, None while it is (or unlocked)."""
    try:
        if lock is not None:
            lock.check(final.name)
    except SaveDirectoryLost as e:
        return e
    return None


def _vanished(plan: SavePlan, error: BaseException) -> SaveDirectoryLost | None:
    """On rank 0, which made the temporary directory and its subdirectories, the error of a save whose
    files vanished as they were written (``--save`` being deleted, its lock file not yet); None for any
    other failure, and on other ranks (there a missing directory can also be a ``--save`` that is not
    on a shared file system)."""
    if plan.rank == 0 and isinstance(error, FileNotFoundError):
        return directory_lost(plan.save_dir, f"is being deleted while this run uses it ({plan.tmp.name} vanished "
                              f"as it was written)", plan.final.name)
    return None


def _write_and_commit(plan: SavePlan, device, group, lock: SaveLock | None) -> Path:
    tmp, final, error = plan.tmp, plan.final, None
    if plan.rank == 0:
        error = _lost(lock, final)
        try:
            if error is None:
                if lock is None:                            # a locked --save exists: never make it again
                    plan.save_dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)      # left over by a crashed save
                tmp.mkdir()
                (tmp / "rng").mkdir()
        except FileNotFoundError as e:                      # deleted between the check and the mkdir
            error = _lost(lock, final) or _vanished(plan, e) or CheckpointError(
                f"cannot create {tmp} for {FLAG.save}: {e}")
        except OSError as e:
            error = CheckpointError(f"cannot create {tmp} for {FLAG.save}: {e}")
    _agree(error is None, f"creating {tmp}", error, device, group)
    try:
        _write_rank_files(plan)
    except Exception as e:  # noqa: BLE001 - re-raised by _agree after every rank has reported
        error = _lost(lock, final) or _vanished(plan, e) or e       # a directory deleted mid-write: say that
    _agree(error is None, f"saving {final}", error, device, group)
    if plan.rank == 0:
        try:
            error = _lost(lock, final)
            if error is None:
                _commit(plan.save_dir, tmp, final, plan.world_size, plan.index)
        except Exception as e:  # noqa: BLE001 - re-raised by _agree after every rank has reported
            error = _lost(lock, final) or _vanished(plan, e) or e
    _agree(error is None, f"committing {final}", error, device, group)
    return final


def save_checkpoint(save_dir, state, *, chunks, engine, topo, job, extra_rng: dict | None = None,
                    lock: SaveLock | None = None) -> Path:
    """Save weights, optimizer state, RNG states, the train state and the job config. Collective.

    ``state`` is the :class:`megazero.state.TrainState` after ``state.iteration`` steps;
    ``extra_rng``: {name: torch.Generator or object with get_states()/set_states()} saved per rank.
    Returns the checkpoint directory ``save_dir/iter_XXXXXXX``. Non-finite state is refused
    (:class:`NonFiniteState`); :class:`megazero.checkpoint.async_save.AsyncCheckpointWriter` writes in the
    background. ``lock``: rank 0's lock of ``save_dir``, checked as :func:`write_planned` says.
    """
    plan = plan_save(save_dir, state, chunks=chunks, engine=engine, topo=topo, job=job, extra_rng=extra_rng)
    return write_planned(plan, topo.device, lock=lock)


# ----------------------------------------------------------------------------------- load
def model_mismatch(saved_model: dict, model_cfg: ModelConfig) -> tuple[str, object, object] | None:
    """(field, saved value, this run's value) of the first model setting a checkpoint must match and does
    not: the model family, then the fields its spec lists (``ModelSpec.checkpoint_fields``); None when
    they all agree. The one list both the pre-launch check and the load use."""
    defaults = _field_defaults(model_cfg.model_family)
    for name in ("model_family",) + get_model_spec(model_cfg.model_family).checkpoint_fields:
        mine, theirs = getattr(model_cfg, name), saved_model.get(name, defaults[name])
        if mine != theirs:
            return name, theirs, mine
    return None


def saved_job(load_dir) -> dict | None:
    """The job settings (by section) the latest checkpoint under ``load_dir`` stored; None when it holds none."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    return fmt.read_json(fmt.checkpoint_dir(load_dir, iteration) / fmt.INDEX)["job"]


def saved_optimizer(load_dir) -> str | None:
    """Which optimizer wrote the state of the latest checkpoint under ``load_dir`` ("adamw" or "muon"); None
    when it holds none (no checkpoint, or weights only)."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    return fmt.optimizer_name(fmt.read_json(fmt.checkpoint_dir(load_dir, iteration) / fmt.INDEX))


def _check_optimizer(index: dict, job, directory) -> None:
    """The checkpoint's optimizer state was written by the optimizer this run steps with (the rule:
    :meth:`megazero.config.CheckpointConfig.check_resumed_optimizer`)."""
    try:
        job.checkpoint.check_resumed_optimizer(fmt.optimizer_name(index), job.optimizer, f"checkpoint {directory}")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def saved_model_settings(load_dir) -> dict | None:
    """The model settings a checkpoint must match (the family, then its spec's ``checkpoint_fields``) as the
    latest checkpoint under ``load_dir`` stored them (``--use-checkpoint-args``); None when it holds none."""
    job = saved_job(load_dir)
    if job is None:
        return None
    saved = job["model"]
    family = saved.get("model_family", ModelConfig.model_family)
    defaults = _field_defaults(family)
    names = ("model_family",) + get_model_spec(family).checkpoint_fields
    return {name: saved.get(name, defaults[name]) for name in names}


def _field_defaults(family: str) -> dict:
    """The defaults of a family's model fields: a checkpoint written before a field existed was saved with
    its default."""
    return {f.name: f.default for f in dataclasses.fields(get_model_spec(family).config)}


def check_model_compatible(saved_model: dict, model_cfg, where) -> None:
    """Refuse a checkpoint whose model differs in a way that changes shapes or meaning."""
    differs = model_mismatch(saved_model, model_cfg)
    if differs:
        name, theirs, mine = differs
        raise CheckpointError(f"{where} was saved with {name} = {theirs} ({flag(name)}), this run has {mine}: "
                              f"use the checkpoint's model settings")


def _read_rank(reader: CheckpointReader, chunks, engine, topo, job, weights_only: bool) -> int:
    """Fill this rank's pieces (weights, and unless ``weights_only`` its optimizer state) from ``reader``;
    returns the bytes filled. A bf16/fp16 run loading an fp32 checkpoint takes its masters from the
    fp32 weights."""
    pieces = engine.loaded_pieces(weights_only) if engine is not None else _whole_params(chunks)
    owned, filled = 0, []
    with torch.no_grad():
        for piece in pieces:
            _, box, (a, b) = _where(piece, topo, job.model.vocab_size)
            for kind, view in piece.tensors.items():
                key = fmt.tensor_key(_KIND[kind], piece.name)
                if kind == "master" and not reader.has(key):
                    key = fmt.tensor_key(fmt.MODEL, piece.name)
                if a < b:
                    reader.read_piece(key, box, (a, b), view[:b - a])
                    owned += (b - a) * view.element_size()
                    filled.append((describe(key, view.dtype), view[:b - a]))
    damaged = nonfinite_names(filled)
    if damaged:
        raise CheckpointError(f"{reader.dir} holds NaN or inf values in {listed(damaged)}: a run cannot train "
                              f"from them; load an earlier checkpoint, or convert the model again from intact "
                              f"weights")
    return owned


def load_checkpoint(load_dir, *, chunks, engine, topo, job, weights_only: bool = False,
                    iteration: int | None = None, extra_rng: dict | None = None, stats: dict | None = None,
                    load_optim: bool = True, load_rng: bool = True):
    """Load the latest (or ``iteration``'s) checkpoint under ``load_dir`` into this layout. Collective.

    Returns the :class:`megazero.state.TrainState` to continue from (a fresh one with
    ``weights_only``: weights only, no optimizer state, iteration 0), or None when ``load_dir`` holds
    no checkpoint (no tracker file) -- the caller decides whether that is an error. ``load_optim=False``
    (``--no-load-optim``): the optimizer starts fresh (fp32 masters from the loaded weights) while the
    iteration, samples and random states resume; ``load_rng=False`` (``--no-load-rng``): the random states
    stay as the seed made them. ``stats``, when
    given, receives this rank's ``bytes_read`` (tensor bytes and checksums read from files) and
    ``bytes_owned`` (the bytes of state it filled).
    """
    load_dir = Path(load_dir)
    iteration = latest_iteration(load_dir) if iteration is None else iteration
    if iteration is None:
        return None
    directory = fmt.checkpoint_dir(load_dir, iteration)
    error, reader, no_buffer = None, None, []
    try:
        reader = CheckpointReader(directory)
        check_model_compatible(reader.index["job"]["model"], job.model, directory)
        if not weights_only and load_optim and reader.index.get("optimizer") is None:
            raise CheckpointError(f"{directory} holds weights only (no optimizer state): load it with "
                                  f"{FLAG.finetune} (weights only, iteration 0)")
        if not weights_only and load_optim:
            _check_optimizer(reader.index, job, directory)
        owned = _read_rank(reader, chunks, engine, topo, job, weights_only or not load_optim)
        no_buffer = _read_buffers(reader, chunks)
        no_history = None if weights_only else _read_fp8_histories(reader, chunks, topo)
        if stats is not None:
            stats.update(bytes_read=reader.bytes_read, bytes_owned=owned)
    except Exception as e:  # noqa: BLE001 - raised on every rank, the failing rank's message, by the next line
        error = e
    raise_first_error(error)
    if no_buffer and topo.rank == 0:
        log.info("%s holds no %s: it starts as in a fresh run", directory, listed(no_buffer))
    if engine is not None:
        meta = reader.index.get("optimizer") or {}
        engine.loaded(meta.get("step", 0), meta.get("loss_scaler"), weights_only or not load_optim)
    if weights_only:
        return TrainState()
    _say_fp8_histories(reader, no_history, job, topo, directory)
    if not load_rng:
        return TrainState(**reader.index["train_state"])
    try:                                     # each rank reads its own random state: a damaged one is named
        _restore_rng(reader, chunks, topo, job, extra_rng, directory)
    except Exception as e:  # noqa: BLE001 - as above
        error = e
    raise_first_error(error)
    return TrainState(**reader.index["train_state"])


def _read_buffers(reader: CheckpointReader, chunks) -> list[str]:
    """Fill the chunks' persistent buffers from the checkpoint (bitwise); returns the names it lacks."""
    missing = []
    with torch.no_grad():
        for name, buffer in persistent_buffers(chunks).items():
            key = fmt.tensor_key(fmt.MODEL_BUFFER, name)
            if reader.has(key):
                buffer.copy_(reader.read_full(key, buffer.dtype).view(buffer.shape))
            else:
                missing.append(name)
    return missing


def _read_fp8_histories(reader: CheckpointReader, chunks, topo) -> list[str]:
    """Put the checkpoint's amax histories into this rank's linears that scale from them (FP8 delayed
    recipe; another history length is cut or padded, another dp rescales the output-gradient row);
    returns the names of those the checkpoint has none for (they start as in a fresh run: the first step
    scales from the current values)."""
    names = fp8.delayed_linears(chunks) if chunks else []
    found = {name: reader.read_full(fmt.tensor_key(fmt.FP8_HISTORY, name), torch.float32) for name in names
             if reader.has(fmt.tensor_key(fmt.FP8_HISTORY, name))}
    fp8.load_history_state(chunks, found, topo.device, reader.index["layout"]["dp"], topo.dp_size)
    return [name for name in names if name not in found]


def _say_fp8_histories(reader: CheckpointReader, no_history: list[str], job, topo, directory) -> None:
    """Rank 0 says, in one line, what of the checkpoint's FP8 amax histories this run does not use, or which
    of its delayed-scaling linears start without one. Collective when this run scales from histories."""
    if job.fp8.enabled and job.fp8.recipe == "delayed":
        text = f"{len(no_history)} FP8 linear(s) ({no_history[0]}, ...)" if no_history else None
        first = first_over_ranks(text, topo.device)
        if first is not None and topo.rank == 0:
            log.info("%s holds no amax history for %s: their first step scales from the current values, as in a "
                     "fresh run", directory, first)
    elif reader.names(fmt.FP8_HISTORY) and topo.rank == 0:
        why = (f"scales from the current values ({FLAG.fp8_recipe} {job.fp8.recipe})" if job.fp8.enabled
               else f"does not train in FP8 (no {FLAG.fp8_format})")
        log.info("%s holds FP8 amax histories (%s delayed); this run %s: they are not used", directory,
                 FLAG.fp8_recipe, why)


def _restore_rng(reader, chunks, topo, job, extra_rng, directory) -> None:
    saved, mine = dict(reader.index["layout"]), _layout(topo, chunks, job)
    saved["cp"], saved["order"] = saved.get("cp", 1), _canonical_order(saved["order"])   # saved before cp existed
    keys = ("world_size", "tp", "cp", "pp", "dp", "virtual_stages", "order")
    if any(saved[k] != mine[k] for k in keys):
        if topo.rank == 0:
            def shown(lay):
                return ", ".join(f"{k} {lay[k]}" for k in keys)
            log.warning("%s was saved under %s; this run is %s: random states (dropout) start fresh from the seed",
                        directory, shown(saved), shown(mine))
        return
    restore_rng_state(reader.read_json_file(f"rng/rank{topo.rank:05d}.json"), chunks, extra_rng)
