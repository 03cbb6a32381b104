"""Fixed-length GPT samples over an indexed dataset: split, epochs, shuffling, blending, mock data.

A sample is ``seq_length + 1`` consecutive tokens of the document stream (documents back to back,
each ending in the EOD the preprocessing appended); consecutive samples share one token, so
sample ``j`` is tokens ``[j*s, j*s + s]`` of the stream. Three arrays, built once from the seed
with numpy and cached (written atomically, reused by later runs with the same inputs):

* ``doc_idx``: the split's documents (as sequence ids), one random permutation per epoch, for as
  many epochs as ``num_samples`` needs.
* ``sample_idx[j] = (position in doc_idx, token offset)`` where sample ``j`` starts; sample ``j``
  ends at (and includes) ``sample_idx[j + 1]``.
* ``shuffle_idx``: a permutation of the samples. When the last epoch is needed only in part
  (< 80% of it), its samples are shuffled separately and placed last, so the full epochs are all
  seen before any sample of the partial one.

Worked example: documents of 4, 3 and 5 tokens, seq_length 4, one epoch, doc order [2, 0, 1]:
stream = d2[0..4] d0[0..3] d1[0..2] (12 tokens) -> (12 - 1) // 4 = 2 samples:
sample 0 = stream[0..4] = d2 (5 tokens), sample 1 = stream[4..8] = d2[4], d0[0..3];
sample_idx = [(0, 0), (0, 4), (1, 3)].

Blending (``--data-path 0.3 a 0.7 b``): sample ``i`` of the blend comes from the dataset whose
count lags its target ``weight * (i + 1)`` the most (ties: the first), so after any prefix of ``n``
samples every dataset has ``weight * n`` samples to within one. Each dataset is then built with
exactly the number of samples the blend takes from it.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid

import numpy as np

from megazero.config import FLAG
from megazero.errors import DataError

from .indexed_dataset import IndexedDataset

CACHE_VERSION = "megazero-gpt-1"


# ---------------------------------------------------------------- options ---------------------------

def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised [train, valid, test] weights (missing parts are 0)."""
    try:
        w = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        w = []
    if not w or len(w) > 3 or any(x < 0 for x in w) or sum(w) <= 0:
        raise DataError(f"{FLAG.split} {split!r} must be up to three non-negative weights like 969,30,1")
    w += [0.0] * (3 - len(w))
    return [x / sum(w) for x in w]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Document ranges [begin, end) for train, valid, test: boundaries round(cumulative weight * n)."""
    bounds = [0] + [int(round(c * num_documents)) for c in np.cumsum(parse_split(split))]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float]]:
    """``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` -> (prefixes, normalised weights)."""
    if len(data_path) == 1:
        return [data_path[0]], [1.0]
    if not data_path or len(data_path) % 2:
        raise DataError(f"{FLAG.data_path} takes one prefix or weight-prefix pairs: "
                        f"{FLAG.data_path} 0.3 a_text_document 0.7 b_text_document")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise DataError(f"{FLAG.data_path} weights {data_path[0::2]} must be numbers (weight-prefix pairs)") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"{FLAG.data_path} weights {weights} must be non-negative with a positive sum")
    return list(data_path[1::2]), [w / sum(weights) for w in weights]


# ---------------------------------------------------------------- index building --------------------

def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream holds ``num_samples`` samples of seq_length + 1 tokens."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_doc_idx(sequence_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """One permutation of ``sequence_ids`` per epoch, concatenated."""
    return np.concatenate([rng.permutation(sequence_ids) for _ in range(num_epochs)]).astype(np.int64)


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] (position in doc_idx, offset) of token ``j * seq_length`` of the stream."""
    cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=cum[1:])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if num_samples and starts[-1] >= cum[-1]:
        raise AssertionError("stream too short for the requested samples")
    pos = np.searchsorted(cum, starts, side="right") - 1
    return np.stack([pos, starts - cum[pos]], axis=1)


def build_shuffle_idx(num_samples: int, first_part: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of range(num_samples), shuffling [0, first_part) and [first_part, n) separately."""
    head = rng.permutation(first_part).astype(np.int64)
    tail = first_part + rng.permutation(num_samples - first_part).astype(np.int64)
    return np.concatenate([head, tail])


def build_blending_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample, its index within that dataset); see the module doc."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.empty(num_samples, dtype=np.int16)
    local = np.empty(num_samples, dtype=np.int64)
    order = range(len(w))
    for i in range(num_samples):
        t = i + 1
        d = max(order, key=lambda k: w[k] * t - counts[k])
        which[i], local[i] = d, counts[d]
        counts[d] += 1
    return which, local


# ---------------------------------------------------------------- caching ---------------------------

class IndexCache:
    """Arrays stored as ``{dir}/{name}-{key}-{array}.npy``, written once under a temporary name and
    renamed into place; ``{...}-done.json`` is written last and marks the set as complete.

    Who writes: ``is_writer`` ranks build and save when the set is missing; then ``barrier()`` (if
    given) is called by every rank; then every rank loads. A non-writer that still finds nothing
    (e.g. a cache directory that is not shared between nodes) builds the arrays itself and saves them.
    ``directory=None`` keeps everything in memory.
    """

    def __init__(self, directory: str | None, is_writer: bool = True, barrier=None):
        self.directory, self.is_writer, self.barrier = directory, is_writer, barrier

    def get(self, name: str, description: dict, names: tuple[str, ...], build) -> dict[str, np.ndarray]:
        if self.directory is None:
            return build()
        key = hashlib.sha256(json.dumps({**description, "v": CACHE_VERSION}, sort_keys=True).encode()).hexdigest()[:20]
        base = os.path.join(self.directory, f"{name}-{key}")
        arrays = None
        if self.is_writer and not os.path.exists(base + "-done.json"):
            arrays = self._save(base, description, build())
        if self.barrier is not None:
            self.barrier()
        if arrays is None and not os.path.exists(base + "-done.json"):
            arrays = self._save(base, description, build())
        return arrays if arrays is not None else {n: np.load(f"{base}-{n}.npy", mmap_mode="r") for n in names}

    @staticmethod
    def _save(base: str, description: dict, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            os.makedirs(os.path.dirname(base), exist_ok=True)
        except OSError as e:
            raise DataError(f"cannot create the index cache directory {os.path.dirname(base)} ({e}): "
                            f"pass a writable {FLAG.data_cache_path}") from e
        tmp = f".tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"   # unique even across hosts
        for n, a in arrays.items():
            with open(f"{base}-{n}.npy{tmp}", "wb") as f:
                np.save(f, a)
            os.replace(f"{base}-{n}.npy{tmp}", f"{base}-{n}.npy")
        with open(f"{base}-done.json{tmp}", "w") as f:
            json.dump(description, f, indent=1)
        os.replace(f"{base}-done.json{tmp}", base + "-done.json")
        return arrays


def _file_identity(prefix: str) -> dict:
    st = os.stat(prefix + ".idx")
    return {"prefix": os.path.abspath(prefix), "idx_size": st.st_size, "idx_mtime_ns": st.st_mtime_ns,
            "bin_size": os.path.getsize(prefix + ".bin")}


def check_vocab(indexed: IndexedDataset, vocab_size: int, cache: IndexCache | None = None) -> None:
    """Raise :class:`DataError` when the data holds ids >= the tokenizer's vocab size."""
    cache = cache or IndexCache(None)
    got = cache.get("maxid", {**_file_identity(indexed.prefix), "what": "max token id"}, ("max",),
                    lambda: {"max": np.array([indexed.max_token_id()], dtype=np.int64)})
    top = int(got["max"][0])
    if top >= vocab_size:
        raise DataError(f"{indexed.prefix}.bin holds token id {top} but the tokenizer's vocab has only "
                        f"{vocab_size} ids: the data was made with another tokenizer; pass the same "
                        f"{FLAG.tokenizer_type}/{FLAG.vocab_file}/{FLAG.tokenizer_model} used by "
                        f"tools/preprocess_data.py")


# ---------------------------------------------------------------- datasets --------------------------

class GPTDataset:
    """``num_samples`` (or a few more) samples of ``seq_length + 1`` tokens from documents
    ``[doc_begin, doc_end)`` of an indexed dataset. ``ds[i]`` -> int64 array."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache: IndexCache | None = None, name: str = "train"):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        begin, end = doc_range
        seq_begin, seq_end = int(indexed.document_indices[begin]), int(indexed.document_indices[end])
        sizes = np.asarray(indexed.sequence_lengths)
        tokens = int(sizes[seq_begin:seq_end].sum(dtype=np.int64))
        if tokens <= seq_length and num_samples > 0:
            raise DataError(f"{indexed.prefix}: the {name} split (documents {begin}..{end}) has {tokens} tokens, "
                            f"too few for one sample of {FLAG.seq_length} {seq_length} + 1: give it more data "
                            f"({FLAG.split}) or lower {FLAG.seq_length}")
        description = {**_file_identity(indexed.prefix), "docs": [begin, end], "seq_length": seq_length,
                       "num_samples": num_samples, "seed": seed, "split": name}

        def build():
            return self.build_indices(sizes, np.arange(seq_begin, seq_end), tokens, num_samples, seed)

        idx = (cache or IndexCache(None)).get(f"gpt-{name}", description, ("doc_idx", "sample_idx", "shuffle_idx"), build)
        self.doc_idx, self.sample_idx, self.shuffle_idx = idx["doc_idx"], idx["sample_idx"], idx["shuffle_idx"]

    def build_indices(self, sizes, sequence_ids, tokens, num_samples, seed) -> dict[str, np.ndarray]:
        s = self.seq_length
        epochs = num_epochs_needed(tokens, s, num_samples)
        rng = np.random.RandomState(seed)
        doc_idx = build_doc_idx(sequence_ids, epochs, rng)
        total = (epochs * tokens - 1) // s
        full = ((epochs - 1) * tokens - 1) // s if epochs > 1 else 0
        per_epoch = (tokens - 1) // s
        first_part = full if epochs > 1 and (num_samples - full) < 0.8 * per_epoch else total
        return {"doc_idx": doc_idx, "sample_idx": build_sample_idx(sizes, doc_idx, s, total),
                "shuffle_idx": build_shuffle_idx(total, first_part, rng)}

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_idx[i])
        (d0, o0), (d1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        get = self.indexed.get
        if d0 == d1:
            return get(int(self.doc_idx[d0]), int(o0), int(o1 - o0 + 1)).astype(np.int64)
        parts = [get(int(self.doc_idx[d0]), int(o0))]
        parts += [get(int(self.doc_idx[k])) for k in range(d0 + 1, d1)]
        parts.append(get(int(self.doc_idx[d1]), 0, int(o1 + 1)))
        return np.concatenate(parts).astype(np.int64)


class BlendedDataset:
    """Samples drawn from several datasets in the proportions of ``weights`` (module doc)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int, which=None, local=None):
        if which is None:
            which, local = build_blending_indices(weights, num_samples)
        self.datasets, self.weights, self.which, self.local = datasets, weights, which, local

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.which[i])][int(self.local[i])]


class MockGPTDataset:
    """Deterministic synthetic samples, no files: sample ``i`` is an arithmetic sequence
    ``(a + b*t) mod vocab`` with (a, b) drawn from ``(seed, i)`` -- learnable by a small model."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} outside [0, {self.num_samples})")
        a, b = np.random.RandomState([self.seed % 2**32, i]).randint(0, self.vocab_size, size=2)
        return (a + b * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size


# ---------------------------------------------------------------- entry point -----------------------

def default_cache_dir(prefix: str) -> str:
    """Where index caches go when --data-cache-path is not given: beside the data, like Megatron."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def build_train_valid_test_datasets(cfg, *, seq_length: int, seed: int, num_samples: tuple[int, int, int],
                                    vocab_size: int | None = None, is_writer: bool = True, barrier=None):
    """[train, valid, test] datasets (``None`` where a split is empty or no samples are asked for).

    ``cfg`` is a :class:`megazero.config.DataConfig`: ``mock_data``, or ``data_path`` (one prefix or
    weight-prefix pairs) split by ``split`` over documents; ``data_cache_path`` (default: ``cache/``
    beside the first prefix) holds the index caches. ``vocab_size``: the tokenizer's, checked against
    the largest id in each .bin. Index caches are written by ``is_writer`` ranks (pass
    ``rank == 0``) and read by the others after ``barrier()`` (pass ``torch.distributed.barrier``);
    every rank must call this with the same arguments.
    """
    if cfg.mock_data:
        if vocab_size is None:
            raise DataError(f"{FLAG.mock_data} needs the vocab size (from the tokenizer or {FLAG.vocab_size})")
        return [MockGPTDataset(n, seq_length, vocab_size, seed + 1000 * k) if n else None
                for k, n in enumerate(num_samples)]
    if not cfg.data_path:
        raise DataError(f"no data: pass {FLAG.data_path} PREFIX (from tools/preprocess_data.py) or {FLAG.mock_data}")
    prefixes, weights = parse_data_path(list(cfg.data_path))
    cache = IndexCache(cfg.data_cache_path or default_cache_dir(prefixes[0]), is_writer, barrier)
    indexed = []
    for p in prefixes:
        for ext in (".idx", ".bin"):
            if not os.path.isfile(p + ext):
                raise DataError(f"{FLAG.data_path} {p!r}: {p + ext} not found (give the prefix without .bin/.idx, "
                                f"e.g. my_corpus_text_document)")
        ds = IndexedDataset(p)
        if vocab_size is not None:
            check_vocab(ds, vocab_size, cache)
        indexed.append(ds)
    out = []
    for k, name in enumerate(("train", "valid", "test")):
        out.append(_build_split(indexed, weights, k, name, cfg.split, num_samples[k], seq_length, seed, cache))
    return out


def _build_split(indexed, weights, k, name, split, n, seq_length, seed, cache):
    ranges = [split_ranges(split, ds.num_documents)[k] for ds in indexed]
    if n == 0 or all(b == e for b, e in ranges):
        return None
    if len(indexed) == 1:
        return GPTDataset(indexed[0], ranges[0], n, seq_length, seed, cache, name)
    desc = {"weights": weights, "num_samples": n, "split": name, "seed": seed,
            "datasets": [_file_identity(ds.prefix) for ds in indexed]}
    blend = cache.get(f"blend-{name}", desc, ("which", "local"),
                      lambda: dict(zip(("which", "local"), build_blending_indices(weights, n))))
    counts = np.bincount(blend["which"], minlength=len(indexed))
    parts = [GPTDataset(ds, r, int(c), seq_length, seed, cache, name) if c else None
             for ds, r, c in zip(indexed, ranges, counts)]
    return BlendedDataset(parts, weights, n, blend["which"], blend["local"])
