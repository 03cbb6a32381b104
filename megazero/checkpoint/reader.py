"""Reading a checkpoint: any part of any tensor, checking every byte it reads (see :mod:`.format`).

    reader = CheckpointReader(directory)
    reader.read_piece("model/layers.0.mlp.dense_h_to_4h.weight", box, (a, b), out)   # what a rank owns
    reader.read_full("model/final_norm.weight")                                          # tools
    reader.bytes_read                                                                    # tensor bytes so far

JSON files and version-1 tensor files are checked against the manifest's sha256 when first opened;
version-2 pieces by the crc32 of each block read (a flipped byte is reported with the file's name
before the data is used).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from megazero.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    MODEL,
    global_region,
    read_json,
    sha256_of,
)
from megazero.checkpoint.regions import (
    Box,
    intersect,
    numel,
    overlap_runs,
    piece_boxes,
    runs,
)
from megazero.errors import CheckpointError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _TensorFile:
    """A safetensors file read by byte ranges (``os.pread``): no mapping of the whole file, and every
    byte read is a byte counted."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.header = json.loads(os.pread(self.fd, n, 8))
        self.data_start = 8 + n

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the 1-D tensor ``key``."""
        entry = self.header[key]
        dtype = _DTYPES[entry["dtype"]]
        size = torch.empty(0, dtype=dtype).element_size()
        begin, end = entry["data_offsets"]
        if not 0 <= lo <= hi <= (end - begin) // size:
            raise ValueError(f"elements [{lo}, {hi}) of {key!r} are outside its {(end - begin) // size}")
        out = torch.empty((hi - lo) * size, dtype=torch.uint8)        # read straight into the tensor
        if out.numel() and os.preadv(self.fd, [out.numpy()], self.data_start + begin + lo * size) != out.numel():
            raise ValueError(f"{key!r} is cut short")
        return out.view(dtype)

    def close(self) -> None:
        os.close(self.fd)


class CheckpointReader:
    """Reads tensors, or any piece of them, from one checkpoint directory."""

    def __init__(self, directory: str | os.PathLike, verify: bool = True):
        self._handles: dict = {}
        self._files: dict[str, _TensorFile] = {}
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.manifest = read_json(self.dir / MANIFEST)
        if not isinstance(self.manifest, dict) or not isinstance(self.manifest.get("files"), dict):
            raise CheckpointError(f"{self.dir / MANIFEST} lists no files: it is corrupted")
        self.verify = verify
        self._checked_size: set[str] = set()
        self._checked_sha: set[str] = set()
        self.index = read_json(self._whole_file_checked(INDEX))
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{self.dir / INDEX} is not a {FORMAT_NAME} index")
        if self.index.get("version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{self.dir} has format version {self.index['version']}; this megazero "
                                  f"reads up to {FORMAT_VERSION}: upgrade megazero")
        self.tensors: dict = self.index.get("tensors")
        if not isinstance(self.tensors, dict):
            raise CheckpointError(f"{self.dir / INDEX} lists no tensors: it is corrupted")
        self.bytes_read = 0

    # ------------------------------------------------------------------ files
    def _size_checked(self, file_name: str) -> Path:
        path = self.dir / file_name
        if file_name in self._checked_size or not self.verify:
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
        self._checked_size.add(file_name)
        return path

    def _whole_file_checked(self, file_name: str) -> Path:
        path = self._size_checked(file_name)
        if file_name in self._checked_sha or not self.verify:
            return path
        if sha256_of(path) != self.manifest["files"][file_name]["sha256"]:
            raise CheckpointError(f"checkpoint file {path} fails its sha256 check: the file is corrupted")
        self._checked_sha.add(file_name)
        return path

    def verify_all(self) -> list[str]:
        """Check every file of the manifest against its sha256; returns their names."""
        names = sorted(self.manifest.get("files", {}))
        for name in names:
            self._whole_file_checked(name)
        return names

    def verify_shapes(self) -> int:
        """Check every shard the index lists against the file that stores it: its region lies inside the
        tensor's shape, and the stored tensor has as many elements (and the dtype) the index says.
        Returns the number of shards checked; :class:`CheckpointError` names the first that differs."""
        count = 0
        for name, entry in self.tensors.items():
            shape = entry["shape"]
            for shard in entry["shards"]:
                box = shard["slice"]
                if len(box) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
                    raise CheckpointError(f"{self.dir / INDEX}: a shard of {name!r} covers {box}, outside its shape "
                                          f"{shape}: the index is corrupted")
                want, stored = self._stored_size(name, shard)
                if stored != want:
                    raise CheckpointError(f"{self.dir / shard['file']} stores {stored} elements under "
                                          f"{shard['key']!r}, the index says {want} (tensor {name!r} of shape "
                                          f"{shape}): the index does not describe the file")
                count += 1
        return count

    def _stored_size(self, name: str, shard: dict) -> tuple[int, int]:
        """(elements the index says a shard holds, elements its file stores under its key)."""
        try:
            if "flat" in shard:
                a, b = shard["flat"]
                if not 0 <= a <= b <= numel(shard["slice"]):
                    raise CheckpointError(f"{self.dir / INDEX}: a shard of {name!r} holds elements [{a}, {b}) of a "
                                          f"region of {numel(shard['slice'])}: the index is corrupted")
                entry = self._file(shard["file"]).header[shard["key"]]
                stored = int(np.prod(entry["shape"], dtype=np.int64))
                if _DTYPES[entry["dtype"]] != getattr(torch, self.tensors[name]["dtype"]):
                    raise CheckpointError(f"{self.dir / shard['file']} stores {shard['key']!r} as "
                                          f"{entry['dtype']}, the index says {self.tensors[name]['dtype']}: the "
                                          f"index does not describe the file")
                return b - a, stored
            stored = int(np.prod(self._handle(shard["file"]).get_slice(shard["key"]).get_shape(), dtype=np.int64))
            return numel(shard["slice"]), stored
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{self.dir / shard['file']} has no usable tensor {shard.get('key')!r} for "
                                  f"{name!r} ({e}): the index does not describe the file") from None

    def read_json_file(self, file_name: str) -> dict:
        return read_json(self._whole_file_checked(file_name))

    def _handle(self, file_name: str):
        """Version 1 files: opened through safetensors after their sha256 check."""
        if file_name not in self._handles:
            path = self._whole_file_checked(file_name)
            try:
                self._handles[file_name] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - a corrupted header: say which file
                raise CheckpointError(f"checkpoint file {path} cannot be opened ({e}): it is corrupted") from None
        return self._handles[file_name]

    def _file(self, file_name: str) -> _TensorFile:
        """Version 2 files: read by byte ranges after their size check."""
        if file_name not in self._files:
            path = self._size_checked(file_name)
            try:
                self._files[file_name] = _TensorFile(path)
            except (OSError, ValueError, struct.error) as e:   # a corrupted header: say which file
                raise CheckpointError(f"checkpoint file {path} cannot be opened ({e}): it is corrupted") from None
        return self._files[file_name]

    def close(self) -> None:
        for f in getattr(self, "_files", {}).values():
            f.close()
        getattr(self, "_files", {}).clear()
        getattr(self, "_handles", {}).clear()

    def __del__(self) -> None:
        try:                                  # also after an __init__ that refused the directory
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report from a destructor
            pass

    # ---------------------------------------------------------------- tensors
    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return self._entry(name)["shape"]

    def names(self, kind: str = MODEL) -> list[str]:
        """Parameter names of tensors of one kind (``model``, ``optim.exp_avg``, ...)."""
        prefix = kind + "/"
        return sorted(n[len(prefix):] for n in self.tensors if n.startswith(prefix))

    def _entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise CheckpointError(f"{self.dir} has no tensor {name!r}: it was saved from a different model "
                                  f"(or without optimizer state)")
        return self.tensors[name]

    def read_piece(self, name: str, box: Box, rng: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
        """Fill the 1-D ``out`` (``b - a`` elements) with flat range [a, b) of ``box`` of tensor ``name``."""
        entry = self._entry(name)
        if len(box) != len(entry["shape"]) or any(hi > n for (_, hi), n in zip(box, entry["shape"])):
            raise CheckpointError(f"tensor {name!r} in {self.dir} has global shape {entry['shape']}, the model "
                                  f"needs region {box}: the model config differs from the checkpoint's")
        covered = 0
        for shard in entry["shards"]:
            if "flat" in shard:
                covered += self._copy_from_piece(shard, box, rng, out)
            else:
                covered += self._copy_from_box(shard, box, rng, out)
        if covered != rng[1] - rng[0]:
            raise CheckpointError(f"the shards of {name!r} in {self.dir} cover {covered} of the "
                                  f"{rng[1] - rng[0]} elements needed: the checkpoint is incomplete")
        return out

    def _copy_from_piece(self, shard: dict, box: Box, rng, out: torch.Tensor) -> int:
        """Version 2: copy the elements a 1-D stored piece shares with the needed piece, reading
        (and checking) only the blocks that hold them."""
        sa, sb = shard["flat"]
        todo = overlap_runs(shard["slice"], (sa, sb), box, rng)
        if not todo:
            return 0
        block = shard["block"]
        spans = []                                   # merged [first block, last block] with their runs
        for s, d, n in todo:
            j0, j1 = (sa + s) // block, (sa + s + n - 1) // block
            if spans and j0 <= spans[-1][1] + 1:
                spans[-1][1] = max(spans[-1][1], j1)
                spans[-1][2].append((s, d, n))
            else:
                spans.append([j0, j1, [(s, d, n)]])
        for j0, j1, span_runs in spans:
            lo, data = self._read_blocks(shard, j0, j1)
            for s, d, n in span_runs:
                out[d:d + n] = data[s - lo:s - lo + n].to(out.dtype)
        return sum(n for _, _, n in todo)

    def _read_blocks(self, shard: dict, j0: int, j1: int) -> tuple[int, torch.Tensor]:
        """Blocks j0..j1 of a piece, checked: (piece offset of the first element, the elements)."""
        sa, sb = shard["flat"]
        block, first = shard["block"], shard["flat"][0] // shard["block"]
        lo, hi = max(sa, j0 * block) - sa, min(sb, (j1 + 1) * block) - sa
        tensor_file = self._file(shard["file"])
        try:
            data = tensor_file.read(shard["key"], lo, hi)
            crcs = tensor_file.read(shard["crc"], j0 - first, j1 - first + 1)
        except (KeyError, ValueError, TypeError) as e:    # a corrupted header or a missing key: say which file
            raise CheckpointError(f"checkpoint file {self.dir / shard['file']} cannot give {shard['key']!r} "
                                  f"({e}): it is corrupted") from None
        raw = data.contiguous().view(torch.uint8).numpy()
        size = data.element_size()
        want = crcs.numpy().view(np.uint32)
        start = sa + lo
        cuts = [0] + [j * block - start for j in range(j0 + 1, j1 + 1)] + [hi - lo]
        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            if zlib.crc32(raw[a * size:b * size]) != int(want[k]):
                raise CheckpointError(f"checkpoint file {self.dir / shard['file']} fails its checksum in "
                                      f"{shard['key']!r} (block {j0 + k}): the file is corrupted")
        self.bytes_read += raw.nbytes + 4 * len(want)
        return lo, data

    def _copy_from_box(self, shard: dict, box: Box, rng, out: torch.Tensor) -> int:
        """Version 1: a stored box (an N-d tensor), checked by its file's sha256."""
        covered = 0
        for part_of_needed in piece_boxes(box, *rng):
            part = intersect(part_of_needed, shard["slice"])
            if part is None:
                continue
            src = self._handle(shard["file"]).get_slice(shard["key"])
            data = src[tuple(slice(lo - s, hi - s) for (lo, hi), (s, _) in zip(part, shard["slice"]))]
            data = data.reshape(-1)
            self.bytes_read += data.numel() * data.element_size()
            for s, d, n in runs(part, part, box):
                out[d - rng[0]:d - rng[0] + n] = data[s:s + n].to(out.dtype)
            covered += numel(part)
        return covered

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (global shape)."""
        entry = self._entry(name)
        out = torch.empty(entry["shape"], dtype=dtype or getattr(torch, entry["dtype"]))
        box = [[0, n] for n in entry["shape"]]
        self.read_piece(name, box, (0, numel(box)), out.view(-1))
        return out

    def read_local(self, name: str, local_shape, partition_dim: int, tp_rank: int, tp_size: int,
                   vocab_size: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The tp-local tensor of parameter-shaped tensor ``name`` (``vocab_size``: see
        :func:`megazero.checkpoint.format.global_region`; padded vocab rows zero)."""
        _, box = global_region(local_shape, partition_dim, tp_rank, tp_size, vocab_size)
        out = torch.zeros(tuple(local_shape), dtype=dtype)
        self.read_piece(name, box, (0, numel(box)), out.view(-1))
        return out
