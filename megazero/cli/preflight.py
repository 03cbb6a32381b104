"""Checks of everything a run will read or write, before any process group, model or dataset exists.

``validate()`` (megazero/config/) checks the flags against each other; this module checks them
against the machine: the backend against the hardware, ``--compile`` against this torch,
``--wandb-project`` and ``--tensorboard-dir`` against the installed packages, the output paths are
writable, ``--save`` holds no other run's checkpoints, ``--load`` holds a checkpoint of this model,
every data prefix has agreeing ``.idx``/``.bin`` files whose token ids the tokenizer's vocabulary
covers, ``--nvme-path`` is a writable directory with room for every local rank's swap files. Last,
once nothing refuses the run, ``--save`` is locked for it (a refused run leaves it untouched).
A failure is one line naming the flag, the file and the fix.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from megazero.checkpoint.distributed import model_mismatch
from megazero.checkpoint.format import (
    INDEX,
    checkpoint_dir,
    read_json,
    read_tracker,
    recover,
)
from megazero.checkpoint.lock import SaveLock
from megazero.compile import compile_unavailable
from megazero.config import FLAG, JobConfig, flag
from megazero.data.gpt_dataset import split_ranges
from megazero.data.indexed_dataset import IndexedDataset
from megazero.errors import CheckpointError, NothingToDo, PreflightError
from megazero.memory.estimate import estimate_memory
from megazero.metrics import tensorboard_missing, wandb_missing
from megazero.profiling import trace_dir


def preflight(job: JobConfig, backend: str | None, rank: int, say=print) -> SaveLock | None:
    """Run every check (see the module docstring). Then, last, rank 0 takes ``--save``'s lock and tidies
    the directory after a crash (so a refused run leaves the directory as it was); keep the returned
    lock for the whole run and release it at the end."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise PreflightError("--backend nccl needs CUDA, and this machine has no usable GPU: use --backend gloo "
                             "(or leave --backend out)")
    _compile(job, backend)
    _writable_file(job.logging.metrics_file, FLAG.metrics_file)
    _writable_dir(job.logging.tensorboard_dir, FLAG.tensorboard_dir)
    _watching(job)
    _writable_dir(job.data.data_cache_path, FLAG.data_cache_path)
    _nvme_path(job)
    try:
        _checkpoints(job)
        finished = None
    except NothingToDo as e:                  # said after the lock: a run still writing there comes first
        finished = e
    if finished is None:
        _data(job, scan=rank == 0, say=say if rank == 0 else (lambda line: None))
    if rank != 0 or not job.checkpoint.save:
        if finished is not None:
            raise finished
        return None
    _writable_dir(job.checkpoint.save, FLAG.save)
    try:
        lock = SaveLock.acquire(job.checkpoint.save)
    except (CheckpointError, OSError) as e:
        raise PreflightError(str(e)) from None
    if finished is not None:
        lock.release()
        raise finished
    if lock.previous:
        say(f" took over the lock of {FLAG.save} {job.checkpoint.save} left by a run that has ended ({lock.previous})")
    for line in recover(job.checkpoint.save):
        say(f" {FLAG.save} {job.checkpoint.save}: {line}")
    return lock


def _watching(job: JobConfig) -> None:
    """``--wandb-project`` needs wandb installed and ``--tensorboard-dir`` tensorboard; the profiler's and
    W&B's directories can be written."""
    lg = job.logging
    if lg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise PreflightError(wandb_missing())
    if lg.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise PreflightError(tensorboard_missing())
    if lg.profile:
        _writable_dir(trace_dir(lg, job.checkpoint.save), FLAG.profile_dir)    # the default's fix is this flag
    _writable_dir(lg.wandb_save_dir, FLAG.wandb_save_dir)


def _compile(job: JobConfig, backend: str | None) -> None:
    """``--compile`` needs a torch that compiles on this machine (on a CPU, inductor needs a C++ compiler)."""
    if not job.compilation.compile:
        return
    cuda = backend != "gloo" and torch.cuda.is_available()
    why = compile_unavailable("cuda" if cuda else "cpu")
    if why:
        raise PreflightError(f"{FLAG.compile}: {why}: drop {FLAG.compile} (the run is the same, uncompiled)")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_dir(path: str | None, what: str) -> None:
    """``path`` is a directory, or can be made one, that this user can write."""
    if not path:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PreflightError(f"{what} {path} is a file, not a directory: give a directory")
    base = _nearest_existing(p)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise PreflightError(f"{what} {path}: {base} is not a writable directory: choose a path you can write")


def _nvme_path(job: JobConfig) -> None:
    """``--nvme-path`` exists, is a writable directory, and has room for the swap files of every rank of
    this node (the estimate's NVMe bytes of the largest pipeline stage, times the local ranks)."""
    path = job.zero.nvme_path
    if not path:
        return
    p = Path(path)
    if not p.exists():
        raise PreflightError(f"{FLAG.nvme_path} {path} does not exist: give an existing directory on a fast local "
                             f"drive (the run creates and removes its swap files under it)")
    if not p.is_dir():
        raise PreflightError(f"{FLAG.nvme_path} {path} is a file, not a directory: give a directory on a fast local "
                             f"drive")
    try:                                      # a real file, not os.access: read-only mounts, root on NFS
        fd, probe = tempfile.mkstemp(dir=p, prefix=".megazero-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PreflightError(f"{FLAG.nvme_path} {path} is not writable ({e.strerror}): choose a directory you can "
                             f"write") from None

    per_rank = max(e.nvme for e in estimate_memory(job))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    free = shutil.disk_usage(p).free
    if per_rank * ranks > free:
        raise PreflightError(f"{FLAG.nvme_path} {path} has {free / 2**30:.2f} GiB free, the swap files need "
                             f"{per_rank * ranks / 2**30:.2f} GiB ({per_rank / 2**30:.2f} GiB per rank x {ranks} ranks on "
                             f"this node): free space there, choose a larger drive, or offload to cpu")


def _writable_file(path: str | None, what: str) -> None:
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise PreflightError(f"{what} {path} is a directory: give a file path (e.g. {path}/metrics.jsonl)")
    if p.exists() and not os.access(p, os.W_OK):
        raise PreflightError(f"{what} {path} is not writable")
    _writable_dir(str(p.parent), f"{what} {path}: its directory")


def _saved_model(directory: Path) -> dict:
    return read_json(directory / INDEX)["job"]["model"]


def _checkpoints(job: JobConfig) -> None:
    """``--save`` holds no other run; ``--load`` (other than ``--save``) holds a checkpoint; a checkpoint
    to be resumed is of this model."""
    ck = job.checkpoint
    same = ck.load and ck.save and Path(ck.load).resolve() == Path(ck.save).resolve()
    try:
        saved = read_tracker(ck.save) if ck.save else None
        loaded = read_tracker(ck.load) if ck.load and not same else None
    except CheckpointError as e:
        raise PreflightError(str(e)) from None
    if saved is not None and not same and not ck.finetune:
        raise PreflightError(f"{FLAG.save} {ck.save} already holds another run's checkpoints (latest iteration "
                             f"{saved}): add {FLAG.load} {ck.save} to resume that run, or choose a new {FLAG.save} "
                             f"directory")
    if ck.load and not same and loaded is None:
        what = "does not exist" if not os.path.isdir(ck.load) else "holds no checkpoint"
        raise PreflightError(f"{FLAG.load} {ck.load} {what}: point {FLAG.load} at a {FLAG.save} directory of an "
                             f"earlier run, or set {FLAG.load} equal to {FLAG.save} to start fresh and resume "
                             f"automatically after a restart")
    for path, iteration in ((ck.save, saved), (ck.load, loaded)):
        if iteration is None:
            continue
        try:
            theirs = _saved_model(checkpoint_dir(path, iteration))
        except CheckpointError as e:
            raise PreflightError(str(e)) from None
        differs = model_mismatch(theirs, job.model)
        if differs:
            name, saved, mine = differs
            raise PreflightError(f"{path} was saved with {flag(name)} {saved}, this run has {mine}: use the "
                                 f"checkpoint's model settings or another directory")
    resumed = (saved if same else loaded) if ck.load else None
    if resumed is not None and not ck.finetune and resumed >= job.train.train_iters:
        raise NothingToDo(f"{FLAG.load} {ck.load} holds a checkpoint at iteration {resumed}, and "
                          f"{FLAG.train_iters} is {job.train.train_iters}: nothing is left to train (raise "
                          f"{FLAG.train_iters} to train further, or add {FLAG.finetune} to start a new run from "
                          f"its weights)")


def _data(job: JobConfig, scan: bool, say=print) -> None:
    """Every prefix opens (its .idx and .bin agree) and each split it gives samples to holds at least one
    sample; with ``scan``, its token ids lie in [0, vocabulary size) (one pass over the .bin,
    memory-mapped). An empty validation split is said (validation will not run), not refused."""
    paths = job.data.data_path
    prefixes = paths if len(paths) == 1 else paths[1::2]
    for prefix in prefixes:
        try:
            ds = IndexedDataset(prefix)
        except (OSError, ValueError) as e:
            raise PreflightError(f"{FLAG.data_path} {prefix}: {e}") from None
        _splits(job, prefix, ds, say)
        if not scan or ds.num_tokens == 0:
            continue
        low, high = ds.token_range()
        if low < 0 or high >= job.model.vocab_size:
            raise PreflightError(f"{FLAG.data_path} {prefix}: token ids span [{low}, {high}] but the tokenizer's "
                                 f"vocabulary has {job.model.vocab_size} entries: the data was made with another "
                                 f"tokenizer; preprocess it with this one (tools/preprocess_data.py)")


def _splits(job: JobConfig, prefix: str, ds: IndexedDataset, say) -> None:
    """Each split of ``--split`` that the run draws samples from holds more than ``--seq-length`` tokens
    (one sample); an empty validation split is said, since no evaluation will run."""
    import numpy as np

    d, seq = job.data, job.model.seq_length
    wanted = {"training": True, "validation": job.train.eval_iters > 0, "test": job.train.eval_iters > 0}
    sizes = np.asarray(ds.sequence_lengths)
    for (begin, end), (name, used) in zip(split_ranges(d.split, ds.num_documents), wanted.items()):
        if not used:
            continue
        if begin == end and name != "training":
            if name == "validation":
                say(f" note: the validation split of {FLAG.split} {d.split!r} holds none of the "
                    f"{ds.num_documents} documents of {FLAG.data_path} {prefix}: validation will not run (give "
                    f"{FLAG.split} a larger validation weight, or {FLAG.eval_iters} 0)")
            continue
        first, last = int(ds.document_indices[begin]), int(ds.document_indices[end])
        tokens = int(sizes[first:last].sum(dtype=np.int64))
        if tokens <= seq:
            raise PreflightError(f"{FLAG.data_path} {prefix}: the {name} split of {FLAG.split} {d.split!r} "
                                 f"(documents {begin}..{end}) holds {tokens} tokens, too few for one sample of "
                                 f"{FLAG.seq_length} {seq} + 1: give that split a larger weight in {FLAG.split}, use "
                                 f"more data, or lower {FLAG.seq_length}")
