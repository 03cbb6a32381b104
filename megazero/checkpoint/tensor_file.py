"""Writing one rank's pieces into a safetensors file, streamed, with a checksum per block of elements.

Every piece is a 1-D tensor (its flat range of a box, :mod:`megazero.checkpoint.regions`) stored
under its key, followed at the end of the file by a ``crc32/<key>`` table of int32: the crc32 of each
*block* of the piece. Blocks are aligned in the coordinates of the piece's box (block j covers box
elements [j * B, (j + 1) * B), cut to the piece's range), so a reader of any part of any piece checks
exactly the blocks it reads, and not the rest of the file. B is a power of two that divides the
box's last dim into at least 4 parts (a later tp split of that dim, up to 4, then reads whole
blocks), at most 4096 and at least 16 elements: the checksums cost 4 bytes per B elements (under
3% from a 128-wide last dim in fp32, 0.1% at 4096).

The file is written from the given tensors directly (no copy of the set in memory: one piece is
moved to the CPU at a time), its sha256 computed on the way for the manifest. The result is a
plain safetensors file: ``safetensors.safe_open`` reads it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from megazero.checkpoint.regions import Box

CRC = "crc32"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def block_size(box: Box) -> int:
    """Elements per checksum block of a piece of ``box`` (see the module docstring)."""
    width = (box[-1][1] - box[-1][0]) if box else 1
    b = 4096
    while b > 16 and (width % b or b * 4 > width):
        b //= 2
    return b


def crc_key(key: str) -> str:
    return f"{CRC}/{key}"


def block_crcs(data: memoryview, first: int, start: int, block: int, itemsize: int) -> np.ndarray:
    """crc32 of each block of a piece whose data starts at box element ``start``; ``first`` is the
    first block's index (``start // block``)."""
    n = len(data) // itemsize
    cuts = [0] + [(j * block - start) for j in range(first + 1, first + 1 + (start + n - 1) // block - first)] + [n]
    return np.array([zlib.crc32(data[a * itemsize:b * itemsize]) for a, b in zip(cuts[:-1], cuts[1:])],
                    dtype=np.uint32).view(np.int32)


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def write_pieces(path: Path, pieces: list[tuple[str, list[int], Box, tuple[int, int], torch.Tensor]],
                 metadata: dict | None = None) -> tuple[dict, dict]:
    """Write ``[(key, global shape, box, (a, b), 1-D tensor of b - a elements)]`` to ``path``.

    Returns (index entries ``{key: {"shape", "dtype", "shards": [one shard]}}``, ``{file name: record}``)
    where a shard is ``{"file", "key", "slice": box, "flat": [a, b], "block": B, "crc": crc key}``.
    """
    header, entries, crc_tables, offset = {}, {}, [], 0
    for key, shape, box, (a, b), tensor in pieces:
        if tensor.numel() != b - a or tensor.dim() != 1:
            raise ValueError(f"piece {key!r}: a 1-D tensor of {b - a} elements expected, got {tuple(tensor.shape)}")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPES[tensor.dtype], "shape": [b - a], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        block = block_size(box)
        nblocks = (b - 1) // block - a // block + 1 if b > a else 0
        crc_tables.append((crc_key(key), nblocks, a, block))
        entries[key] = {"shape": list(shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shards": [{"file": path.name, "key": key, "slice": [list(r) for r in box],
                                    "flat": [a, b], "block": block, "crc": crc_key(key)}]}
    for ckey, nblocks, _, _ in crc_tables:
        header[ckey] = {"dtype": "I32", "shape": [nblocks], "data_offsets": [offset, offset + 4 * nblocks]}
        offset += 4 * nblocks
    header["__metadata__"] = {k: str(v) for k, v in (metadata or {}).items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        def put(data) -> None:
            f.write(data)
            sha.update(data)

        put(struct.pack("<Q", len(head)) + head)
        tables = []
        for (_, _, _, _, tensor), (_, _, a, block) in zip(pieces, crc_tables):
            data = _bytes(tensor)
            put(data)
            tables.append(block_crcs(data, a // block, a, block, tensor.element_size()) if len(data) else
                          np.zeros(0, dtype=np.int32))
        for table in tables:
            put(memoryview(table).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return entries, {path.name: {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}}
