"""The on-disk checkpoint format: layout-free tensors in safetensors files, a JSON index, a manifest.

A checkpoint directory ``DIR/iter_0000100/`` holds::

    index.json                      what is in the checkpoint (see below), the run's state and config
    manifest.json                   every other file's size and sha256, verified on load
    model_tp00_pp000.safetensors    tensors written by one (tp, pp) position (dp rank 0 of it)
    rng/rank00000.json              per-rank random states (Python, NumPy, torch, the TP RNG tracker)

Every tensor is stored under a stable name with its *global* (layout-free) shape; a file holds a
rectangular slice of it. Names: ``model/<parameter name>`` (the weights) and
``optim.<exp_avg|exp_avg_sq|master>/<parameter name>`` (Adam moments, and fp32 master weights when
the parameters are bf16/fp16; fp32 masters *are* the weights and are not stored twice). The
optimizer state of a parameter has the parameter's shape, so it is sliced like the weight.

Worked example, ``layers.0.mlp.dense_h_to_4h.weight`` (full [128, 32], split on dim 0) saved at tp=2::

    "model/layers.0.mlp.dense_h_to_4h.weight": {"shape": [128, 32], "dtype": "float32", "shards": [
        {"file": "model_tp00_pp000.safetensors", "key": "model/layers.0...", "slice": [[0, 64], [0, 32]]},
        {"file": "model_tp01_pp000.safetensors", "key": "model/layers.0...", "slice": [[64, 128], [0, 32]]}]}

A reader at tp=4 wants rows [32, 64) on tp rank 1 and reads them from the first file alone.

The vocabulary padding depends on tp (``make_vocab_size_divisible_by * tp``), so the word embedding
and untied output layer are stored with exactly ``vocab_size`` rows; padded rows are zero in the
model (and in its optimizer state) and are re-created as zeros on load.

Nothing is pickled: tensors go through safetensors, everything else through JSON.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_NAME = "megazero-checkpoint"
FORMAT_VERSION = 1
INDEX = "index.json"
MANIFEST = "manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"
MODEL, EXP_AVG, EXP_AVG_SQ, MASTER = "model", "optim.exp_avg", "optim.exp_avg_sq", "optim.master"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


def tensor_key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


# ------------------------------------------------------------------------------------- regions
def global_region(local_shape, partition_dim: int, tp_rank: int, tp_size: int,
                  vocab_size: int | None = None) -> tuple[list[int], list[list[int]]]:
    """(global shape, [[lo, hi] per dim]) of the part of a parameter that a tp rank holds.

    The tp-local tensor's element ``[i, j]`` is global ``[lo0 + i, lo1 + j]``. ``vocab_size``: given
    for a parameter whose dim 0 is the padded vocabulary (``vocab_padded``): the global shape has
    exactly ``vocab_size`` rows and the region is clipped to them (padded rows are not stored).

    >>> global_region((32, 16), 1, 1, 2)
    ([32, 32], [[0, 32], [16, 32]])
    """
    shape = [int(n) for n in local_shape]
    region = [[0, n] for n in shape]
    if partition_dim >= 0 and tp_size > 1:
        n = shape[partition_dim]
        shape[partition_dim] = n * tp_size
        region[partition_dim] = [tp_rank * n, (tp_rank + 1) * n]
    if vocab_size is not None:
        shape[0] = vocab_size
        region[0] = [min(region[0][0], vocab_size), min(region[0][1], vocab_size)]
    return shape, region


def region_numel(region) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in region)


def stored_part(local: torch.Tensor, region) -> torch.Tensor:
    """The part of a tp-local tensor that is stored (drops padded vocab rows)."""
    return local[tuple(slice(0, hi - lo) for lo, hi in region)].contiguous()


# ------------------------------------------------------------------------------------- writing
def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file (or a directory entry) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def write_tensor_file(directory: Path, file_name: str, parts: list[tuple[str, list[int], list, torch.Tensor]]
                      ) -> tuple[dict, dict]:
    """Write ``[(stable name, global shape, region, tensor)]`` to one safetensors file.

    Returns (index entries {name: {"shape", "dtype", "shards": [one shard]}}, {file_name: record}).
    """
    tensors, entries = {}, {}
    for name, shape, region, tensor in parts:
        if region_numel(region) == 0:
            continue
        tensors[name] = tensor.detach().to("cpu").contiguous()
        entries[name] = {"shape": list(shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                         "shards": [{"file": file_name, "key": name, "slice": [list(r) for r in region]}]}
    path = directory / file_name
    save_file(tensors, str(path), metadata={"format": FORMAT_NAME})
    fsync_path(path)
    return entries, {file_name: file_record(path)}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    fsync_path(path)


def merge_entries(into: dict, entries: dict) -> None:
    """Add one file's index entries (same tensor from several files: shards are concatenated)."""
    for name, e in entries.items():
        if name in into:
            if into[name]["shape"] != e["shape"]:
                raise CheckpointError(f"tensor {name!r} written with global shapes {into[name]['shape']} "
                                      f"and {e['shape']}")
            into[name]["shards"].extend(e["shards"])
        else:
            into[name] = {"shape": e["shape"], "dtype": e["dtype"], "shards": list(e["shards"])}


def commit(save_dir: Path, tmp: Path, final: Path, index: dict, files: dict) -> None:
    """Finish a checkpoint written into ``tmp``: index and manifest, rename to ``final``, then the
    tracker by an atomic rename. Until the rename the checkpoint does not exist for readers; until
    the tracker is replaced the previous checkpoint stays the latest."""
    write_json(tmp / INDEX, index)
    files = dict(files)
    files[INDEX] = file_record(tmp / INDEX)
    write_json(tmp / MANIFEST, {"format": FORMAT_NAME, "files": files})
    for sub in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        fsync_path(sub)
    old = save_dir / f".{final.name}.old"
    if final.exists():                       # re-saving an iteration: keep it until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_path(save_dir)
    replace_tracker(save_dir, index["iteration"])
    shutil.rmtree(old, ignore_errors=True)


def replace_tracker(save_dir: Path, iteration: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` by an atomic rename."""
    tracker_tmp = save_dir / (TRACKER + ".tmp")
    tracker_tmp.write_text(f"{iteration}\n")
    fsync_path(tracker_tmp)
    os.replace(tracker_tmp, save_dir / TRACKER)
    fsync_path(save_dir)


# ------------------------------------------------------------------------------------- reading
def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({e}): it is corrupted") from None


class CheckpointReader:
    """Reads tensors (or any rectangular part of them) from one checkpoint directory.

    Every file is checked against the manifest (size and sha256) the first time it is opened, so a
    flipped byte is reported with the file's name before any of its content is used.
    """

    def __init__(self, directory: str | os.PathLike, verify: bool = True):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.manifest = read_json(self.dir / MANIFEST)
        self.verify = verify
        self._verified: set[str] = set()
        self.index = json.loads(self._checked(INDEX).read_text())
        if self.index.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{self.dir / INDEX} is not a {FORMAT_NAME} index")
        if self.index.get("version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{self.dir} has format version {self.index['version']}; this megazero "
                                  f"reads up to {FORMAT_VERSION}: upgrade megazero")
        self.tensors: dict = self.index["tensors"]
        self._handles: dict = {}

    def _checked(self, file_name: str) -> Path:
        path = self.dir / file_name
        if file_name in self._verified or not self.verify:
            return path
        record = self.manifest.get("files", {}).get(file_name)
        if record is None:
            raise CheckpointError(f"{path} is not listed in {self.dir / MANIFEST}: the checkpoint is corrupted")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, the manifest says "
                                  f"{record['bytes']}: the file is truncated or corrupted")
        if sha256_of(path) != record["sha256"]:
            raise CheckpointError(f"checkpoint file {path} fails its sha256 check: the file is corrupted")
        self._verified.add(file_name)
        return path

    def verify_all(self) -> list[str]:
        """Check every file of the manifest; returns their names."""
        names = sorted(self.manifest.get("files", {}))
        for name in names:
            self._checked(name)
        return names

    def read_json_file(self, file_name: str) -> dict:
        return json.loads(self._checked(file_name).read_text())

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            self._handles[file_name] = safe_open(str(self._checked(file_name)), framework="pt")
        return self._handles[file_name]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return self._entry(name)["shape"]

    def _entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise CheckpointError(f"{self.dir} has no tensor {name!r}: it was saved from a different model "
                                  f"(or without optimizer state)")
        return self.tensors[name]

    def read_region(self, name: str, region, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out[: hi-lo, ...]`` with global elements ``region`` of tensor ``name``."""
        entry = self._entry(name)
        if len(region) != len(entry["shape"]) or any(hi > n for (_, hi), n in zip(region, entry["shape"])):
            raise CheckpointError(f"tensor {name!r} in {self.dir} has global shape {entry['shape']}, the model "
                                  f"needs region {region}: the model config differs from the checkpoint's")
        covered = 0
        for shard in entry["shards"]:
            inter = [[max(a, s[0]), min(b, s[1])] for (a, b), s in zip(region, shard["slice"])]
            if any(lo >= hi for lo, hi in inter):
                continue
            src = self._handle(shard["file"]).get_slice(shard["key"])
            part = src[tuple(slice(lo - s[0], hi - s[0]) for (lo, hi), s in zip(inter, shard["slice"]))]
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, region))] = part.to(out.dtype)
            covered += region_numel(inter)
        if covered != region_numel(region):
            raise CheckpointError(f"the shards of {name!r} in {self.dir} cover {covered} of the "
                                  f"{region_numel(region)} elements needed: the checkpoint is incomplete")
        return out

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (global shape)."""
        entry = self._entry(name)
        out = torch.empty(entry["shape"], dtype=dtype or getattr(torch, entry["dtype"]))
        return self.read_region(name, [[0, n] for n in entry["shape"]], out)

    def read_local(self, name: str, local_shape, partition_dim: int, tp_rank: int, tp_size: int,
                   vocab_size: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The tp-local tensor of parameter-shaped tensor ``name`` (``vocab_size``: see
        :func:`global_region`; padded vocab rows zero)."""
        _, region = global_region(local_shape, partition_dim, tp_rank, tp_size, vocab_size)
        out = torch.zeros(tuple(local_shape), dtype=dtype)
        return self.read_region(name, region, out)

    def names(self, kind: str = MODEL) -> list[str]:
        """Parameter names of tensors of one kind (``model``, ``optim.exp_avg``, ...)."""
        prefix = kind + "/"
        return sorted(n[len(prefix):] for n in self.tensors if n.startswith(prefix))


def read_tracker(save_dir: str | os.PathLike) -> int | None:
    """The iteration named by ``DIR/latest_checkpointed_iteration.txt``, or None without one."""
    path = Path(save_dir) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}: "
                              f"fix or delete the file") from None
