"""The on-disk checkpoint format: layout-free tensor pieces in safetensors files, a JSON index, a manifest.

A checkpoint directory ``DIR/iter_0000100/`` holds::

    index.json                 what is in the checkpoint (see below), the run's state and config, and
                               which optimizer wrote its state (``"optimizer": {"name": "adamw" | "muon",
                               "step", "loss_scaler"}``; null: weights only)
    manifest.json              every other file's size and sha256
    rank00003.safetensors      the pieces rank 3 owns (weights, fp32 masters, Adam moments, FP8 amax
                               histories) + checksums
    rng/rank00003.json         per-rank random states (Python, NumPy, torch, the TP RNG tracker)

Every tensor is stored under a stable name with its *global* (layout-free) shape. Names:
``model/<parameter name>`` (the weights) and ``optim.<exp_avg|exp_avg_sq|master>/<parameter name>``
(Adam moments, and fp32 master weights when the parameters are bf16/fp16; fp32 masters *are* the
weights and are not stored twice). Optimizer state has its parameter's shape and is cut like it. Under
``--optimizer muon`` the layers' matrices keep Muon's momentum under ``optim.exp_avg`` (and zeros under
``optim.exp_avg_sq``): the index's ``optimizer.name`` says which optimizer's state a checkpoint holds (a
checkpoint written before the name was recorded holds AdamW's, :func:`optimizer_name`).
``fp8.amax_history/<linear name>`` ([3, history], fp32): under ``--fp8-recipe delayed``, the amax history
of one FP8 linear (input, weight, output gradient; :mod:`megazero.parallel.fp8`), the same on every rank
holding the layer, so one of them writes it whole; a run that does not scale from histories ignores it.
Its output-gradient row is in the saving run's units (dp times the serial run's), rescaled at load.
``model.buffer/<buffer name>``: a model's persistent buffers, state it keeps that gradients do not train
(an MoE router's ``layers.<i>.mlp.router.expert_bias`` [E] fp32), whole, the same on every rank holding
its module, written once; a run whose model has such a buffer that the checkpoint lacks starts it as a
fresh run would (zeros) and says so.

Each rank writes what it owns, in parallel: for every ZeRO bucket, its data-parallel shard of the
elements (weights too, so replicated weights are written once, split over the dp ranks), of the
parameters it counts once (:func:`megazero.parallel.params.counts_once`). A *piece* is the part of a
tensor one file holds: a box of the global tensor (the writer's tp-local region) and a flat range of
that box in row-major order (its shard), stored as a 1-D tensor (:mod:`.regions`). Worked example,
``layers.0.attention.dense.weight`` (global [32, 32], split on dim 1) saved at tp=2 dp=2, ZeRO
shards cutting each tp-local [32, 16] weight after its 200th element::

    "model/layers.0.attention.dense.weight": {"shape": [32, 32], "dtype": "float32", "shards": [
        {"file": "rank00000.safetensors", "slice": [[0, 32], [0, 16]],  "flat": [0, 200], ...},
        {"file": "rank00002.safetensors", "slice": [[0, 32], [0, 16]],  "flat": [200, 512], ...},
        {"file": "rank00001.safetensors", "slice": [[0, 32], [16, 32]], "flat": [0, 200], ...}, ...]}

A loading rank reads, from each piece, only the elements it will own (its tp-local region, and
under ZeRO only its shard), whatever layout wrote them: the bytes read per rank are about the bytes
it owns. Each piece carries a crc32 per block of elements (:mod:`.tensor_file`), checked as the
blocks are read; the manifest's sha256 of whole files is for tools that verify everything
(``tools/inspect_checkpoint.py``). Version 1 checkpoints (one file per (tp, pp) position, whole boxes
checked by the file's sha256) still load.

The vocabulary padding depends on tp (``make_vocab_size_divisible_by * tp``), so parameters marked
``vocab_padded`` are stored with exactly ``vocab_size`` rows; padded rows are zero in the model (and
in its optimizer state) and are re-created as zeros on load.

Nothing is pickled: tensors go through safetensors, everything else through JSON.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

from megazero.errors import CheckpointError

FORMAT_NAME = "megazero-checkpoint"
FORMAT_VERSION = 2          # 1: one file per (tp, pp) position, whole boxes; 2: one file per rank, pieces
INDEX = "index.json"
MANIFEST = "manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"
MODEL, EXP_AVG, EXP_AVG_SQ, MASTER = "model", "optim.exp_avg", "optim.exp_avg_sq", "optim.master"
FP8_HISTORY = "fp8.amax_history"
MODEL_BUFFER = "model.buffer"


def optimizer_name(index: dict) -> str | None:
    """Which optimizer wrote a checkpoint's state ("adamw" or "muon"), from its index; None when it holds
    weights only. Checkpoints written before the name was recorded hold AdamW's."""
    meta = index.get("optimizer")
    return None if meta is None else meta.get("name", "adamw")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(rank: int) -> str:
    """The tensor file a rank writes (a tools' writer uses one per (tp, pp) position: ``rank`` = its index)."""
    return f"rank{rank:05d}.safetensors"


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


def write_failed(error: OSError, tmp: Path, final: Path, what: str | None = None) -> CheckpointError:
    """The one-line error of a save that the file system refused (``No space left on device``, ...),
    after removing the half-written ``tmp``: the previous checkpoint stays the latest. ``what`` failed
    (default: writing ``final``)."""
    shutil.rmtree(tmp, ignore_errors=True)
    why = error.strerror or str(error)
    fix = "free space there or save elsewhere" if error.errno == errno.ENOSPC else "fix that and run again"
    return CheckpointError(f"{what or f'writing {final}'} failed: {why} ({fix}); the half-written {tmp.name} was "
                           f"removed and the previous checkpoint, if any, stays the latest")


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


def checkpoint_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """Where iteration ``iteration``'s checkpoint is. A crash while an iteration was saved again can
    leave it only as ``.iter_N.old`` (moved aside, the new one not yet in place): read that one."""
    final = Path(save_dir) / iter_dir_name(iteration)
    old = Path(save_dir) / f".{final.name}.old"
    return old if not final.exists() and (old / MANIFEST).is_file() else final


def recover(save_dir: str | os.PathLike) -> list[str]:
    """Tidy a save directory after a crash (call with the directory's lock held): put a moved-aside
    checkpoint back where the new one never arrived, drop moved-aside copies whose replacement
    is in place and half-written temporaries. Returns what was done, for the log."""
    save_dir, done = Path(save_dir), []
    for old in sorted(save_dir.glob(".iter_*.old")):
        final = save_dir / old.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (replaced by {final.name})")
        else:
            old.rename(final)
            done.append(f"restored {final.name} from {old.name}")
    for tmp in sorted(save_dir.glob(".iter_*.tmp")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed the half-written {tmp.name}")
    return done


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
