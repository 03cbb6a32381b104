"""Tokenizers behind one small interface: ``tokenize``, ``detokenize``, ``vocab_size``, ``eod``.

Four kinds, named as Megatron names them (``--tokenizer-type``; its other names: docs/megatron-flags.md):

* ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``--vocab-file`` (``vocab.json``/``encoder.json``)
  and ``--merge-file`` (``merges.txt``/``vocab.bpe``). Backed by ``tiktoken``, built from the local
  files (no network). tiktoken encodes by merge *rank*; for GPT-2 files the id of every merged token
  is ``256 + its line in the merge file``, so ranks and merges agree. We check that when loading,
  and fall back to HuggingFace ``tokenizers`` (which follows the merge list itself) for BPE files
  where it does not hold. Measured on the 1 MB Jargon File, one thread: tiktoken ~17 MB/s,
  ``tokenizers`` ~2 MB/s, identical ids.
* ``SentencePieceTokenizer``: a ``--tokenizer-model`` file, via ``sentencepiece``. The end-of-document
  id is the model's ``</s>`` (eos); a model trained without one gets an extra id ``vocab_size``.

* ``HuggingFaceTokenizer``: a HuggingFace ``tokenizer.json`` (Llama 3, Mistral, Qwen2, ... as
  published), given as ``--tokenizer-model`` (the file, or the model directory holding it), through
  the ``tokenizers`` library. Ids are the library's ``encode(text).ids``, with whatever special
  tokens the file's post-processor adds (Llama 3's ``<|begin_of_text|>``), as Megatron's
  HuggingFaceTokenizer (``AutoTokenizer(text).input_ids``) gives them. ``eod`` is the end-of-sequence
  token: ``eos_token`` of the directory's ``tokenizer_config.json``, else ``eos_token_id`` of its
  ``config.json``, else the first of ``</s>``, ``<|end_of_text|>``, ``<|endoftext|>``, ``<eos>`` the
  vocabulary has.

* ``NullTokenizer``: no vocabulary file: ``--vocab-size`` ids and an end-of-document id after them, for data
  already in ids (Megatron's, whose vocabulary is likewise ``--vocab-size`` + 1).

Text in the end-of-text form ``<|endoftext|>`` is encoded as ordinary text, as the original GPT-2
encoder (and Megatron's) does: only ``eod`` ids added by the preprocessing mark document ends.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from megazero.config import FLAG, TOKENIZERS
from megazero.errors import TokenizerError

# GPT-2's pre-tokenisation pattern (contractions, letters, numbers, other, whitespace).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


class Tokenizer:
    """Common interface. ``tokenize(text) -> list[int]``; ``detokenize(ids) -> str``."""

    name = "base"
    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


def _check_file(path: str | None, flag: str) -> str:
    if not path:
        raise TokenizerError(f"{flag} is required for this tokenizer type")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path!r}: no such file; pass the path of an existing file")
    return path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map, in byte
    order, to code points 256, 257, ... This is how vocab.json spells raw bytes as text.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _load_gpt2_files(vocab_file: str, merge_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{FLAG.vocab_file} {vocab_file!r} is not a JSON token->id map ({e})") from e
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"{FLAG.vocab_file} {vocab_file!r} must hold a non-empty JSON object token->id")
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (n == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"{FLAG.merge_file} {merge_file!r} line {n}: expected two tokens, got {line!r}")
            merges.append((parts[0], parts[1]))
    return vocab, merges


def _ranks_follow_merges(vocab: dict[str, int], merges: list[tuple[str, str]]) -> bool:
    """True when ids are ranks: the 256 byte tokens first, then merge i -> id 256 + i."""
    byte_ids = sorted(vocab[c] for c in bytes_to_unicode().values() if c in vocab)
    if byte_ids != list(range(256)):
        return False
    return all(vocab.get(a + b) == 256 + i for i, (a, b) in enumerate(merges))


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE. ``backend`` "auto" uses tiktoken when the files allow it (see module doc)."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, backend: str = "auto"):
        self.vocab_file = _check_file(vocab_file, FLAG.vocab_file)
        self.merge_file = _check_file(merge_file, FLAG.merge_file)
        vocab, merges = _load_gpt2_files(vocab_file, merge_file)
        if GPT2_EOD not in vocab:
            raise TokenizerError(f"{FLAG.vocab_file} {vocab_file!r} has no {GPT2_EOD!r} token (the end-of-document id)")
        self.eod = vocab[GPT2_EOD]
        self.vocab_size = max(vocab.values()) + 1
        if backend == "auto":
            backend = "tiktoken" if _ranks_follow_merges(vocab, merges) else "tokenizers"
        if backend == "tiktoken":
            self._build_tiktoken(vocab)
        elif backend == "tokenizers":
            self._build_hf()
        else:
            raise ValueError(f"unknown GPT-2 BPE backend {backend!r}: use auto, tiktoken or tokenizers")
        self.backend = backend

    def _build_tiktoken(self, vocab: dict[str, int]) -> None:
        import tiktoken

        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        ranks = {bytes(to_byte[c] for c in tok): i for tok, i in vocab.items() if tok != GPT2_EOD}
        self._enc = tiktoken.Encoding("megazero_gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={GPT2_EOD: self.eod})
        self.tokenize = self._enc.encode_ordinary
        self.tokenize_batch = lambda texts: self._enc.encode_ordinary_batch(list(texts), num_threads=1)
        self.detokenize = lambda ids: self._enc.decode(list(map(int, ids)))

    def _build_hf(self) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        tok = HFTokenizer(models.BPE.from_file(self.vocab_file, self.merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._hf = tok
        self.tokenize = lambda text: tok.encode(text).ids
        self.tokenize_batch = lambda texts: [e.ids for e in tok.encode_batch(list(texts))]
        self.detokenize = lambda ids: tok.decode(list(map(int, ids)), skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model. ``eod`` is the model's ``</s>``; a model without one gets the extra id
    ``piece_size`` as ``eod`` (and ``vocab_size = piece_size + 1``)."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.model_file = _check_file(model_file, FLAG.tokenizer_model)
        try:     # the SentencePieceProcessor itself (the HF export reads its pieces)
            self.processor = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"{FLAG.tokenizer_model} {model_file!r} is not a SentencePiece model ({e})") from e
        n = self.processor.get_piece_size()
        eos = self.processor.eos_id()
        self.eod = eos if eos >= 0 else n
        self.vocab_size = n if eos >= 0 else n + 1

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.processor.encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        n = self.processor.get_piece_size()
        return self.processor.decode([int(i) for i in ids if int(i) < n])


EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` read by the ``tokenizers`` library (see the module docstring)."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:
            raise TokenizerError(f"{FLAG.tokenizer_type} HuggingFaceTokenizer needs the tokenizers library: "
                                 "pip install tokenizers") from e
        if not path:
            raise TokenizerError(f"{FLAG.tokenizer_model} is required for this tokenizer type (a directory with "
                                 "tokenizer.json, or the file)")
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.model_file = _check_file(file, FLAG.tokenizer_model)
        self.directory = directory
        try:     # the tokenizers.Tokenizer itself (the HF export reads its special tokens)
            self.tokenizer = HFTokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001  (the library raises a bare Exception on bad files)
            raise TokenizerError(f"{FLAG.tokenizer_model} {file!r} is not a HuggingFace tokenizer.json ({e})") from e
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eos(directory)

    def _find_eos(self, directory: str) -> int:
        named = _json_field(os.path.join(directory, "tokenizer_config.json"), "eos_token")
        if isinstance(named, dict):
            named = named.get("content")
        if isinstance(named, str) and self.tokenizer.token_to_id(named) is not None:
            return self.tokenizer.token_to_id(named)
        eos_id = _json_field(os.path.join(directory, "config.json"), "eos_token_id")
        if isinstance(eos_id, list) and eos_id:
            eos_id = eos_id[0]
        if isinstance(eos_id, int) and 0 <= eos_id < self.vocab_size:
            return eos_id
        for token in EOS_CANDIDATES:
            if self.tokenizer.token_to_id(token) is not None:
                return self.tokenizer.token_to_id(token)
        raise TokenizerError(f"{FLAG.tokenizer_model} {self.model_file!r}: no end-of-sequence token found (no "
                             f"eos_token in tokenizer_config.json, no eos_token_id in config.json, none of "
                             f"{', '.join(EOS_CANDIDATES)}): put a tokenizer_config.json naming eos_token beside it")

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer, for data already in token ids: ``--vocab-size N`` ids, plus an end-of-document
    id N (so ``vocab_size`` is N + 1); text is the ids written in decimal, separated by spaces."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod = vocab_size + 1, vocab_size

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _json_field(path: str, key: str):
    """``key`` of the JSON object in ``path``; None when the file or the key is missing."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def build_tokenizer(tokenizer_type: str | None, *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type`` with its files (flag names as in Megatron); NullTokenizer
    takes ``vocab_size`` (``--vocab-size``) instead."""
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError(f"{FLAG.tokenizer_type} NullTokenizer needs {FLAG.vocab_size} N (the ids the data "
                                 f"holds)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise TokenizerError(f"{FLAG.tokenizer_type} must be one of {', '.join(TOKENIZERS)}, got {tokenizer_type!r}")


def tokenizer_from_config(cfg, vocab_size: int | None = None) -> Tokenizer:
    """Build from a :class:`megazero.config.DataConfig` (``tokenizer_type`` and its file fields) and, for
    NullTokenizer, the model's ``vocab_size``."""
    return build_tokenizer(cfg.tokenizer_type, vocab_file=cfg.vocab_file, merge_file=cfg.merge_file,
                           tokenizer_model=cfg.tokenizer_model, vocab_size=vocab_size)
