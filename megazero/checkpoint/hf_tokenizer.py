"""The tokenizer files of a HuggingFace model directory, both directions: an export writes the run's
tokenizer so that ``AutoTokenizer.from_pretrained`` gives the ids megazero's tokenizer gives; an import
records the directory's tokenizer as the checkpoint's.

    special = write_tokenizer(job.data, out_dir, model_max_length=cfg.max_position_embeddings)   # -> bos/eos ids
    data_cfg = tokenizer_of(hf_dir)                                                 # import

What an export writes, by ``--tokenizer-type``:

=========================  ==========================================================================
GPT2BPETokenizer           ``vocab.json``, ``merges.txt``; ``tokenizer_config.json``: ``GPT2Tokenizer``,
                           bos = eos = unk = ``<|endoftext|>``, no prefix space
SentencePieceTokenizer     ``tokenizer.model``; ``tokenizer_config.json``: ``LlamaTokenizer`` with the
                           model's own ``<unk>``/``<s>``/``</s>``/pad pieces, no bos or eos added,
                           ``add_prefix_space`` as the model's dummy prefix
HuggingFaceTokenizer       ``tokenizer.json`` with the directory's ``tokenizer_config.json`` and
                           ``special_tokens_map.json``; when it has no config, one naming the generic
                           ``PreTrainedTokenizerFast`` and the eos (and bos) token
=========================  ==========================================================================

megazero's GPT-2 BPE and SentencePiece tokenizers read text like ``</s>`` or ``<|endoftext|>`` as
ordinary text (as Megatron's do: only the preprocessing's end-of-document ids mark document ends),
so their configs set ``split_special_tokens``: HF then does the same. A ``tokenizer.json`` keeps the
library's own rule (added special tokens in text are special) on both sides. The ids of the
special tokens go into ``config.json`` as ``bos_token_id`` / ``eos_token_id``.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from megazero.config import DataConfig
from megazero.data.sample import TOKENIZER_MODEL
from megazero.data.tokenizers import GPT2_EOD, build_tokenizer
from megazero.errors import TokenizerError

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")


@dataclass(frozen=True)
class SpecialTokens:
    """The ids an HF ``config.json`` records (None: the tokenizer has no such token)."""
    bos: int | None = None
    eos: int | None = None


def run_tokenizer(data_cfg: DataConfig):
    """megazero's tokenizer of a run's data config (the embedded sample's SentencePiece model for the
    default run), or None when it is unknown: mock data, or files that are gone."""
    kind, model = data_cfg.tokenizer_type, data_cfg.tokenizer_model
    if kind is None and not data_cfg.data_path and not data_cfg.mock_data:      # the embedded default run
        kind, model = "SentencePieceTokenizer", str(TOKENIZER_MODEL)
    try:
        return build_tokenizer(kind, vocab_file=data_cfg.vocab_file, merge_file=data_cfg.merge_file,
                               tokenizer_model=model)
    except (TokenizerError, OSError):
        return None


def write_tokenizer(data_cfg: DataConfig, out: Path, model_max_length: int | None = None) -> SpecialTokens:
    """Write the run's tokenizer into ``out`` (see the module docstring); returns its special ids, or
    ``SpecialTokens()`` when the tokenizer is unknown (:func:`run_tokenizer`)."""
    tok = run_tokenizer(data_cfg)
    if tok is None:
        return SpecialTokens()
    common = {"model_max_length": model_max_length} if model_max_length else {}
    if tok.name == "GPT2BPETokenizer":
        return _write_gpt2(tok, out, common)
    if tok.name == "SentencePieceTokenizer":
        return _write_sentencepiece(tok, out, common)
    return _write_hf(tok, out, common)


def _write_config(out: Path, config: dict) -> None:
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _write_gpt2(tok, out: Path, common: dict) -> SpecialTokens:
    shutil.copyfile(tok.vocab_file, out / "vocab.json")
    shutil.copyfile(tok.merge_file, out / "merges.txt")
    _write_config(out, {"tokenizer_class": "GPT2Tokenizer", "bos_token": GPT2_EOD, "eos_token": GPT2_EOD,
                        "unk_token": GPT2_EOD, "add_prefix_space": False, "add_bos_token": False,
                        "split_special_tokens": True, "clean_up_tokenization_spaces": False, **common})
    return SpecialTokens(bos=tok.eod, eos=tok.eod)


def _write_sentencepiece(tok, out: Path, common: dict) -> SpecialTokens:
    sp = tok.processor
    shutil.copyfile(tok.model_file, out / "tokenizer.model")
    ids = {"unk_token": sp.unk_id(), "bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id()}
    named = {key: sp.id_to_piece(i) for key, i in ids.items() if 0 <= i < sp.get_piece_size()}
    _write_config(out, {"tokenizer_class": "LlamaTokenizer", **named, "add_bos_token": False,
                        "add_eos_token": False, "add_prefix_space": _adds_dummy_prefix(sp), "legacy": False,
                        "split_special_tokens": True, "clean_up_tokenization_spaces": False, **common})
    bos = sp.bos_id()
    return SpecialTokens(bos=bos if bos >= 0 else None, eos=tok.eod)


def _adds_dummy_prefix(sp) -> bool:
    """Does the SentencePiece model put a word-boundary mark before the first word (its normalizer's
    ``add_dummy_prefix``)? Asked of the model itself, so no protobuf is needed."""
    pieces = sp.encode("a", out_type=str)
    return bool(pieces) and pieces[0].startswith("\u2581")


def _write_hf(tok, out: Path, common: dict) -> SpecialTokens:
    source = Path(tok.directory)
    shutil.copyfile(tok.model_file, out / "tokenizer.json")
    for name in HF_TOKENIZER_FILES[1:]:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    bos = _named_token(source, "bos_token", tok) or next(
        (tok.tokenizer.token_to_id(t) for t in BOS_CANDIDATES if tok.tokenizer.token_to_id(t) is not None), None)
    if not (out / "tokenizer_config.json").is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.tokenizer.id_to_token(tok.eod),
                  "clean_up_tokenization_spaces": False, **common}
        if bos is not None:
            config["bos_token"] = tok.tokenizer.id_to_token(bos)
        _write_config(out, config)
    return SpecialTokens(bos=bos, eos=tok.eod)


def _named_token(directory: Path, key: str, tok) -> int | None:
    """The id of the token ``key`` names in the directory's tokenizer_config.json, if any."""
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(named, dict):
        named = named.get("content")
    return tok.tokenizer.token_to_id(named) if isinstance(named, str) else None


def tokenizer_of(path: str | Path) -> DataConfig:
    """The data config naming an HF directory's tokenizer: ``tokenizer.json`` (HuggingFaceTokenizer),
    else ``vocab.json`` + ``merges.txt`` (GPT2BPETokenizer), else ``tokenizer.model``
    (SentencePieceTokenizer); an empty one when it has none."""
    path = Path(path).resolve()
    if (path / "tokenizer.json").is_file():
        return DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path))
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(path / "vocab.json"),
                          merge_file=str(path / "merges.txt"))
    if (path / "tokenizer.model").is_file():
        return DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(path / "tokenizer.model"))
    return DataConfig()
