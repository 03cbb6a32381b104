"""Streaming text -> tokens -> ``.bin/.idx`` conversion (the engine of ``tools/preprocess_data.py``).

Memory stays bounded whatever the input size: the input is read in batches of about
``batch_bytes`` of text; at most ``2 * workers`` batches are in flight; finished batches are written
straight to the ``.bin`` in input order. Only the index (12 bytes per document) grows with the input.

* ``workers == 1``: the main process reads, encodes and writes.
* ``workers == N > 1``: N spawned processes encode; the main process reads and writes. (Spawned,
  not forked, so it is safe from a process that holds threads; a script calling :func:`preprocess`
  with workers must guard its entry point with ``if __name__ == "__main__":``.)

Input formats: ``.jsonl``/``.json`` (one JSON object per line; ``json_keys`` name the text fields,
each written to ``{prefix}_{key}_document``) or plain text (documents separated by
``txt_separator``, default a blank line ``"\\n\\n"``; empty documents dropped; written as
``{prefix}_text_document``). Malformed lines (bad JSON, missing or non-string key, bad UTF-8) are
skipped and reported with their line numbers.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .indexed_dataset import IndexedDatasetWriter, best_dtype, bin_path, idx_path
from .tokenizers import build_tokenizer


class PreprocessError(ValueError):
    """Unusable input or options; the message names the file or flag."""


@dataclass
class PreprocessConfig:
    input: str
    output_prefix: str
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    txt_separator: str = "\n\n"
    log_interval: int = 10000          # documents between progress lines (0: none)
    batch_bytes: int = 1 << 18         # text per batch handed to a worker
    overwrite: bool = False            # replace existing outputs (else they are refused)


@dataclass
class PreprocessResult:
    outputs: dict[str, str]                                   # json key -> output prefix
    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (line number, reason)


def is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".json", ".jsonl.txt"))


def _jsonl_batches(path: str, batch_bytes: int):
    """Yield lists of (line number, raw line bytes) of about batch_bytes each."""
    batch, size = [], 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            batch.append((n, line))
            size += len(line)
            if size >= batch_bytes:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def txt_batches(path: str, batch_bytes: int, separator: bytes):
    """Yield lists of (first line number, document bytes), documents split on ``separator``.

    Equal to ``data.split(separator)`` with empty parts dropped, but read in chunks: the text after
    the last separator seen is carried into the next chunk.
    """
    batch, size, carry, line = [], 0, b"", 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(batch_bytes)
            if chunk:
                parts = (carry + chunk).split(separator)
                carry = parts.pop()
            else:
                parts, carry = [carry], b""
            for part in parts:
                if part:
                    batch.append((line, part))
                    size += len(part)
                line += part.count(b"\n") + separator.count(b"\n")
            if size >= batch_bytes or (not chunk and batch):
                yield batch
                batch, size = [], 0
            if not chunk:
                return


_WORKER: dict = {}


def _init_encoder(cfg: PreprocessConfig) -> None:
    _WORKER["tok"] = build_tokenizer(cfg.tokenizer_type, vocab_file=cfg.vocab_file,
                                     merge_file=cfg.merge_file, tokenizer_model=cfg.tokenizer_model)
    _WORKER["cfg"] = cfg


def _texts_of(line: bytes, jsonl: bool, keys) -> list[str]:
    """The texts of one input record, or raise ValueError saying why it is malformed."""
    if not jsonl:
        return [line.decode("utf-8")]
    if not line.strip():
        raise ValueError("blank line")
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    texts = []
    for k in keys:
        if k not in obj:
            raise ValueError(f"missing key {k!r}")
        if not isinstance(obj[k], str):
            raise ValueError(f"key {k!r} is {type(obj[k]).__name__}, not a string")
        texts.append(obj[k])
    return texts


def _encode_batch(batch):
    """Encode one batch -> ({key: (flat ids int32, lengths int64)}, skipped, bytes)."""
    tok, cfg = _WORKER["tok"], _WORKER["cfg"]
    jsonl, keys = is_jsonl(cfg.input), cfg.json_keys
    ids = {k: [] for k in keys}
    lengths = {k: [] for k in keys}
    skipped, nbytes = [], 0
    for n, raw in batch:
        nbytes += len(raw)
        try:
            texts = _texts_of(raw, jsonl, keys)
        except (ValueError, UnicodeDecodeError) as e:
            skipped.append((n, str(e) if not isinstance(e, UnicodeDecodeError) else f"invalid UTF-8 ({e})"))
            continue
        for k, text in zip(keys, texts):
            doc = tok.tokenize(text)
            if cfg.append_eod:
                doc.append(tok.eod)
            ids[k].append(np.asarray(doc, dtype=np.int32))
            lengths[k].append(len(doc))
    out = {k: (np.concatenate(ids[k]) if ids[k] else np.zeros(0, np.int32), np.asarray(lengths[k], np.int64))
           for k in keys}
    return out, skipped, nbytes


def _results(cfg: PreprocessConfig, batches, tok):
    """Encoded batches in input order, in-process or from a bounded window of worker tasks."""
    if cfg.workers == 1:
        _WORKER.update(tok=tok, cfg=cfg)
        for b in batches:
            yield _encode_batch(b)
        return
    with mp.get_context("spawn").Pool(cfg.workers, initializer=_init_encoder, initargs=(cfg,)) as pool:
        pending: deque = deque()
        for b in batches:
            pending.append(pool.apply_async(_encode_batch, (b,)))
            if len(pending) >= 2 * cfg.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _check_inputs(cfg: PreprocessConfig) -> None:
    if not os.path.isfile(cfg.input):
        raise PreprocessError(f"--input {cfg.input!r}: no such file")
    if os.path.getsize(cfg.input) == 0:
        raise PreprocessError(f"--input {cfg.input!r} is empty: nothing to preprocess")
    if cfg.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {cfg.workers}")
    if not cfg.json_keys:
        raise PreprocessError("--json-keys needs at least one key")
    if not is_jsonl(cfg.input) and not cfg.txt_separator:
        raise PreprocessError("--txt-separator must not be empty")
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix {cfg.output_prefix!r}: directory {out_dir} does not exist")
    keys = cfg.json_keys if is_jsonl(cfg.input) else ("text",)
    existing = [f for k in keys for f in (bin_path(f"{cfg.output_prefix}_{k}_document"),
                                         idx_path(f"{cfg.output_prefix}_{k}_document")) if os.path.exists(f)]
    if existing and not cfg.overwrite:
        raise PreprocessError(f"--output-prefix {cfg.output_prefix!r}: {existing[0]} already exists: choose another "
                              f"prefix, or pass --overwrite to replace it")


def preprocess(cfg: PreprocessConfig, log=None) -> PreprocessResult:
    """Tokenize ``cfg.input`` into ``{output_prefix}_{key}_document.bin/.idx``; see the module doc.

    ``log(str)`` receives progress lines and skipped-line reports (default: stderr).
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    _check_inputs(cfg)
    tok = build_tokenizer(cfg.tokenizer_type, vocab_file=cfg.vocab_file, merge_file=cfg.merge_file,
                          tokenizer_model=cfg.tokenizer_model)   # fail fast on bad tokenizer files
    keys = cfg.json_keys if is_jsonl(cfg.input) else ("text",)
    cfg = PreprocessConfig(**{**cfg.__dict__, "json_keys": tuple(keys)})
    res = PreprocessResult(outputs={k: f"{cfg.output_prefix}_{k}_document" for k in keys})
    batches = (_jsonl_batches(cfg.input, cfg.batch_bytes) if is_jsonl(cfg.input)
               else txt_batches(cfg.input, cfg.batch_bytes, cfg.txt_separator.encode("utf-8")))
    writers = {k: IndexedDatasetWriter(p, best_dtype(tok.vocab_size)) for k, p in res.outputs.items()}
    start, next_log = time.perf_counter(), cfg.log_interval
    try:
        for encoded, skipped, nbytes in _results(cfg, batches, tok):
            for k, (ids, lengths) in encoded.items():
                writers[k].add_documents(ids, lengths)
            for n, why in skipped:
                if len(res.skipped) < 20:
                    log(f"skipped {cfg.input} line {n}: {why}")
            res.skipped.extend(skipped)
            res.documents = writers[keys[0]].num_documents
            res.tokens += sum(int(lengths.sum()) for _, lengths in encoded.values())
            res.bytes_read += nbytes
            if cfg.log_interval and res.documents >= next_log:
                next_log = res.documents + cfg.log_interval
                log(_progress(res, time.perf_counter() - start))
        if res.documents == 0:
            raise PreprocessError(f"--input {cfg.input!r}: no documents found ({len(res.skipped)} lines "
                                  f"skipped as malformed); check the format and --json-keys {list(keys)}")
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    res.seconds = time.perf_counter() - start
    log(_progress(res, res.seconds) + " (done)")
    if res.skipped:
        lines = ", ".join(str(n) for n, _ in res.skipped[:100]) + (" ..." if len(res.skipped) > 100 else "")
        log(f"skipped {len(res.skipped)} malformed line(s) of {cfg.input}: {lines}")
    return res


def _progress(res: PreprocessResult, seconds: float) -> str:
    mb = res.bytes_read / 1e6
    return (f"processed {res.documents:,} documents, {res.tokens:,} tokens, {mb:.1f} MB "
            f"({mb / max(seconds, 1e-9):.2f} MB/s)")
