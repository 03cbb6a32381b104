"""The embedded sample corpus (1 MB of the Jargon File, public domain) and its SentencePiece model.

Lets the trainer run on real text with no downloads::

    from megazero.data.sample import default_sample, sample_tokenizer
    prefix = default_sample("cache")      # cache/jargon_sp-<hash>_text_document.bin/.idx
    tok = sample_tokenizer()              # vocab 4000, eod = 2 (</s>)

Documents are the lexicon entries (the text split before each ``"\\n\\n   :"`` entry head, the
first document being the introduction): 1,370 documents, each tokenized and ended with EOD.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    best_dtype,
)
from ..tokenizers import SentencePieceTokenizer

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "jargon-file-4.4.7-1mb.txt"
TOKENIZER_MODEL = HERE / "jargon_sp.model"
NUM_DOCUMENTS = 1370
ENTRY_SEPARATOR = "\n\n   :"


def sample_text() -> str:
    return CORPUS.read_text(encoding="utf-8")


def sample_documents() -> list[str]:
    """The corpus split into its 1,370 documents (introduction, then one per lexicon entry).

    ``"".join`` of them with ``"\\n\\n"`` between consecutive ones gives back the corpus exactly.
    """
    parts = sample_text().split(ENTRY_SEPARATOR)
    return [parts[0]] + ["   :" + p for p in parts[1:]]


def sample_tokenizer() -> SentencePieceTokenizer:
    return SentencePieceTokenizer(str(TOKENIZER_MODEL))


def _content_hash() -> str:
    h = hashlib.sha256()
    for path in (CORPUS, TOKENIZER_MODEL):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def default_sample(cache_dir: str | os.PathLike) -> str:
    """Tokenize the sample corpus once into ``cache_dir`` and return the dataset prefix.

    Idempotent and safe when several ranks call it at once without coordination: each caller that
    finds no complete dataset writes its own temporary files and renames them into place (``.bin``,
    then ``.idx``); the contents are identical, so whichever rename lands last is correct, and a
    reader only ever sees complete files. The name carries a hash of the corpus and the tokenizer
    model, so a changed model never reuses a stale cache.
    """
    os.makedirs(cache_dir, exist_ok=True)
    prefix = os.path.join(os.fspath(cache_dir), f"jargon_sp-{_content_hash()}_text_document")
    try:
        if IndexedDataset(prefix).num_documents == NUM_DOCUMENTS:
            return prefix
    except (IndexedDatasetError, OSError):
        pass
    tok = sample_tokenizer()
    with IndexedDatasetWriter(prefix, best_dtype(tok.vocab_size)) as w:
        for doc in sample_documents():
            w.add_document(tok.tokenize(doc) + [tok.eod])
    return prefix
