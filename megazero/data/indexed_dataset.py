"""Megatron's memory-mapped indexed dataset: a ``.bin`` of raw token ids and an ``.idx`` describing it.

``{prefix}.idx`` layout (little-endian), readable by Megatron-LM / megatron-core and written by them::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)
    uint64    S = number of sequences
    uint64    D = number of document boundaries (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  byte offset of each sequence in the .bin
    int64[D]  document boundaries as sequence indices: 0, ..., S

``{prefix}.bin`` is the sequences' ids back to back. A GPT corpus has one sequence per document,
so for ``docs = [[5, 6, 7], [8, 9]]`` in uint16: lengths ``[3, 2]``, offsets ``[0, 6]``, boundaries
``[0, 1, 2]``, and the .bin holds the 5 ids (10 bytes).

Codes 6 and 7 mean float64/float32 in megatron-core but other things in older copies (DeepSpeed),
and never hold token ids: we neither write nor read them.
"""
from __future__ import annotations

import os
import struct
import uuid
from array import array

import numpy as np

from megazero.config import FLAG

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")   # magic, version, dtype code, sequences, document boundaries
DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_OF_CODE.items()}


class IndexedDatasetError(ValueError):
    """A missing, corrupt, truncated or inconsistent .bin/.idx pair; the message names the file."""


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule: vocab < 65500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDatasetWriter:
    """Streams documents into ``{prefix}.bin`` and writes ``{prefix}.idx`` on :meth:`finalize`.

    Memory held: 12 bytes per sequence and 8 per document (the index), never the tokens. Both files
    are written under temporary names and renamed into place at the end (``.bin`` first), so a reader
    never sees a half-written pair; on an exception inside ``with`` the temporaries are removed.

    >>> with IndexedDatasetWriter("/tmp/x_text_document", np.uint16) as w:   # doctest: +SKIP
    ...     w.add_document([5, 6, 7]); w.add_document([8, 9])
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise IndexedDatasetError(f"{prefix}: cannot write dtype {self.dtype}; use one of "
                                      f"{sorted(str(d) for d in CODE_OF_DTYPE)}")
        self._info = np.iinfo(self.dtype)
        suffix = f".tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"   # unique even across hosts
        self._bin_tmp, self._idx_tmp = bin_path(prefix) + suffix, idx_path(prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array("i")
        self._doc_bounds = array("q", [0])
        self._done = False

    def add_item(self, ids) -> None:
        """Append one sequence (of the current document)."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < self._info.min or ids.max() > self._info.max):
            raise IndexedDatasetError(f"{self.prefix}: token id {int(ids.max())} does not fit the file dtype "
                                      f"{self.dtype}; write with a wider dtype (best_dtype(vocab_size))")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(ids.size))

    def end_document(self) -> None:
        self._doc_bounds.append(len(self._lengths))

    def add_document(self, ids) -> None:
        """Append one document made of one sequence (the GPT layout)."""
        self.add_item(ids)
        self.end_document()

    def add_documents(self, flat_ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: ``flat_ids`` is their ids back to back."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(flat_ids):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(flat_ids)} ids were given")
        self.add_item(flat_ids)
        self._lengths.pop()
        first = len(self._lengths)
        self._lengths.extend(lengths.astype(np.int32).tolist())
        self._doc_bounds.extend(range(first + 1, first + 1 + len(lengths)))

    @property
    def num_documents(self) -> int:
        return len(self._doc_bounds) - 1

    def finalize(self) -> None:
        """Write the .idx and move both files into place."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        bounds = np.frombuffer(self._doc_bounds, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(bounds)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(bounds.tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


def write_indexed_dataset(prefix: str, documents, dtype=np.uint16) -> None:
    """Write an iterable of documents (each a sequence of ids) as one .bin/.idx pair."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)


def _read_index(path: str):
    """Parse and check an .idx file; returns (dtype, lengths, pointers, doc_bounds) as read-only arrays."""
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"{path}: index file not found (expected a Megatron .idx next to the .bin; "
                                  f"pass {FLAG.data_path} without the .bin/.idx suffix)")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise IndexedDatasetError(f"{path}: file is {size} bytes, shorter than the {_HEADER.size}-byte header "
                                  f"(empty or truncated index; re-run tools/preprocess_data.py)")
    magic, version, code, n_seq, n_bounds = _HEADER.unpack(head)
    if magic != MAGIC:
        raise IndexedDatasetError(f"{path}: wrong magic {magic!r}, expected {MAGIC!r}: not a Megatron "
                                  f"mmap indexed dataset (.idx)")
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: index version {version} is not supported (only {VERSION})")
    if code not in DTYPE_OF_CODE:
        raise IndexedDatasetError(f"{path}: dtype code {code} is not a token dtype we read (codes "
                                  f"{sorted(DTYPE_OF_CODE)}; 6/7 are floats whose meaning differs between "
                                  f"Megatron and DeepSpeed)")
    expected = _HEADER.size + 12 * n_seq + 8 * n_bounds
    if size not in (expected, expected + n_seq):   # + n_seq: megatron-core's multimodal mode bytes
        raise IndexedDatasetError(f"{path}: index is {size} bytes but its header ({n_seq} sequences, "
                                  f"{n_bounds} document boundaries) needs {expected}: truncated or corrupt")
    lengths = np.memmap(path, np.int32, "r", _HEADER.size, (n_seq,)) if n_seq else np.zeros(0, np.int32)
    off = _HEADER.size + 4 * n_seq
    pointers = np.memmap(path, np.int64, "r", off, (n_seq,)) if n_seq else np.zeros(0, np.int64)
    bounds = np.memmap(path, np.int64, "r", off + 8 * n_seq, (n_bounds,)) if n_bounds else np.zeros(0, np.int64)
    return np.dtype(DTYPE_OF_CODE[code]), lengths, pointers, bounds


def pointers_consistent(lengths, pointers, itemsize: int, chunk: int = 1 << 24) -> bool:
    """pointers == exclusive running sum of lengths * itemsize, checked in chunks (bounded memory)."""
    expected = 0
    for s in range(0, len(lengths), chunk):
        n = lengths[s:s + chunk].astype(np.int64)
        if n.size and n.min() < 0:
            return False
        want = expected + np.concatenate(([0], np.cumsum(n[:-1]))) * itemsize
        if not np.array_equal(pointers[s:s + chunk], want):
            return False
        expected = int(want[-1]) + int(n[-1]) * itemsize
    return True


class IndexedDataset:
    """Memory-mapped reader. ``ds[i]`` is sequence ``i`` as a numpy view; ``ds.get(i, offset, length)``
    a slice of it. ``document_indices[d]:document_indices[d+1]`` are the sequences of document ``d``.

    Opening checks the header, that the .bin is exactly as long as the index says, that the
    offsets are the running sum of the lengths and that the document boundaries are well formed,
    raising :class:`IndexedDatasetError` naming the file otherwise.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = \
            _read_index(idx_path(prefix))
        self._check_consistency()
        nbytes = os.path.getsize(bin_path(prefix))
        n_tokens = nbytes // self.dtype.itemsize
        self._bin = np.memmap(bin_path(prefix), self.dtype, "r") if n_tokens else np.zeros(0, self.dtype)

    def _check_consistency(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        if not os.path.isfile(bpath):
            raise IndexedDatasetError(f"{bpath}: data file not found (the .idx exists; copy the .bin beside it)")
        lengths, pointers, bounds = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = self.dtype.itemsize
        need = (int(pointers[-1]) + int(lengths[-1]) * itemsize) if len(lengths) else 0
        have = os.path.getsize(bpath)
        if have != need:
            raise IndexedDatasetError(f"{bpath}: data file is {have} bytes but {ipath} describes {need} "
                                      f"({'truncated' if have < need else 'extra bytes'}; the pair does not "
                                      f"match -- re-run tools/preprocess_data.py)")
        if not pointers_consistent(lengths, pointers, itemsize):
            raise IndexedDatasetError(f"{ipath}: sequence offsets are not the running sum of the lengths: corrupt index")
        if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != len(lengths) or np.any(np.diff(bounds) < 0):
            raise IndexedDatasetError(f"{ipath}: document boundaries must rise from 0 to the sequence count "
                                      f"{len(lengths)}: corrupt index")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._bin.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``i`` (a read-only view into the .bin)."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: slice [{offset}, {offset + length}) outside sequence {i} "
                             f"of length {size}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def max_token_id(self, chunk: int = 1 << 26) -> int:
        """Largest id in the .bin (one streaming pass; -1 when empty)."""
        return self.token_range(chunk)[1]

    def token_range(self, chunk: int = 1 << 26) -> tuple[int, int]:
        """(smallest, largest) id in the .bin, in one streaming pass; (0, -1) when empty."""
        low, high = None, -1
        for s in range(0, self.num_tokens, chunk):
            part = self._bin[s:s + chunk]
            low = int(part.min()) if low is None else min(low, int(part.min()))
            high = max(high, int(part.max()))
        return (0 if low is None else low), high
