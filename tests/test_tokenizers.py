"""Tokenizers: GPT-2 BPE ids against an independent library on the whole shared corpus; SentencePiece
round trips; HuggingFace tokenizer.json files through the ``tokenizers`` library (ids equal the
library's on the whole corpus, eos found); clear errors for bad files; the train_tokenizer tool."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.data import GPT2_MERGES, GPT2_VOCAB
from helpers.hf_tokenizers import bos_tokenizer_dir, gpt2_tokenizer_dir

from megazero.config import DataConfig
from megazero.data.sample import CORPUS, TOKENIZER_MODEL, sample_text
from megazero.data.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    bytes_to_unicode,
    tokenizer_from_config,
)
from megazero.errors import TokenizerError

REPO = Path(__file__).resolve().parents[1]
CORPUS_SHA = "3f942aea63845da6dc1023e5e8b942f329986b0bed2844d451b564d53498c188"


@pytest.fixture(scope="module")
def gpt2():
    return GPT2BPETokenizer(str(GPT2_VOCAB), str(GPT2_MERGES))


def _reference_hf():
    """GPT-2 BPE built directly with HuggingFace `tokenizers` (independent of our tiktoken path)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_gpt2_reference_values(gpt2):
    assert gpt2.backend == "tiktoken"
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.eod == 50256 and gpt2.vocab_size == 50257
    assert gpt2.detokenize([15496, 995]) == "Hello world"
    # end-of-text written in the text is ordinary text, as in the original encoder
    assert 50256 not in gpt2.tokenize("a<|endoftext|>b")


def test_gpt2_whole_corpus_matches_reference_library(gpt2):
    text = CORPUS.read_text(encoding="utf-8")
    ours = gpt2.tokenize(text)
    assert len(ours) == 298_534 and ours[:16] == [220] * 16
    assert hashlib.sha256(np.asarray(ours, dtype="<u2").tobytes()).hexdigest() == CORPUS_SHA
    assert ours == _reference_hf().encode(text).ids
    assert gpt2.detokenize(ours) == text


def test_gpt2_hard_strings_match_reference(gpt2):
    ref = _reference_hf()
    for s in ["", " ", "  leading", "trailing  \n\n", "don't I'll we've", "1234567 3.14",
              "ünïcødé 日本語 🎉\t\ttabs", "\u00a0nbsp", "a\r\nb", "x" * 500]:
        assert gpt2.tokenize(s) == ref.encode(s).ids, s
        assert gpt2.detokenize(gpt2.tokenize(s)) == s


def test_gpt2_tokenizers_backend_agrees(gpt2):
    hf = GPT2BPETokenizer(str(GPT2_VOCAB), str(GPT2_MERGES), backend="tokenizers")
    text = sample_text()[:100_000]
    assert hf.tokenize(text) == gpt2.tokenize(text)
    assert hf.detokenize(hf.tokenize(text)) == text


def test_falls_back_when_ids_are_not_merge_ranks(tmp_path):
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"ll": 256, "he": 257, "<|endoftext|>": 258})   # ids NOT in merge order
    (tmp_path / "v.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "m.txt").write_text("#version: 0.2\nh e\nl l\n", encoding="utf-8")
    tok = GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.txt"))
    assert tok.backend == "tokenizers"
    assert tok.tokenize("hello") == [257, 256, vocab["o"]]
    assert tok.eod == 258


def test_sentencepiece_sample_model_round_trips():
    sp = SentencePieceTokenizer(str(TOKENIZER_MODEL))
    assert sp.vocab_size == 4000 and sp.eod == 2
    text = CORPUS.read_text(encoding="utf-8")
    ids = sp.tokenize(text)
    assert sp.detokenize(ids) == text
    for s in ["", "   three spaces", "tabs\t\tand\nnewlines\n\n", "日本語 🎉 ünï", "\x00\x7f"]:
        assert sp.detokenize(sp.tokenize(s)) == s
    assert sp.detokenize(sp.tokenize("ab") + [sp.eod]) == "ab"     # eod is not text


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="--vocab-file.*no such file"):
        GPT2BPETokenizer(str(tmp_path / "nope.json"), str(GPT2_MERGES))
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "m.txt").write_text("a b\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="--vocab-file.*JSON"):
        GPT2BPETokenizer(str(tmp_path / "bad.json"), str(tmp_path / "m.txt"))
    (tmp_path / "bad.model").write_bytes(b"garbage")
    with pytest.raises(TokenizerError, match="--tokenizer-model.*not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "bad.model"))
    with pytest.raises(TokenizerError, match="--tokenizer-model is required"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(TokenizerError, match="--tokenizer-type"):
        build_tokenizer("WordPiece")


def test_tokenizer_from_data_config():
    tok = tokenizer_from_config(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=str(TOKENIZER_MODEL)))
    assert tok.vocab_size == 4000


def test_train_tokenizer_tool_round_trips(tmp_path):
    text = sample_text()[:60_000]
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    subprocess.run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(tmp_path / "in.txt"),
                    "--model-prefix", str(tmp_path / "sp"), "--vocab-size", "400"], check=True, cwd=REPO)
    sp = SentencePieceTokenizer(str(tmp_path / "sp.model"))
    assert sp.vocab_size == 400 and sp.eod == 2
    other = "Unseen: ß∂ƒ 🎉 \t  spaces\n\n"
    assert sp.detokenize(sp.tokenize(text)) == text and sp.detokenize(sp.tokenize(other)) == other


def test_embedded_sample_is_the_published_corpus():
    assert hashlib.sha256(CORPUS.read_bytes()).hexdigest() == \
        "90999871857da8df6f9430cb0e683e82c996b36fff69d0d585698a79a55c3152"


def test_huggingface_tokenizer_json_matches_the_library_on_the_corpus(gpt2, tmp_path):
    from tokenizers import Tokenizer

    directory = gpt2_tokenizer_dir(tmp_path / "gpt2")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(directory))
    text = CORPUS.read_text(encoding="utf-8")
    ids = tok.tokenize(text)
    assert ids == Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids
    assert ids == gpt2.tokenize(text)                       # the same BPE as the GPT-2 files
    assert (tok.vocab_size, tok.eod) == (50257, 50256) and tok.detokenize(ids) == text
    assert HuggingFaceTokenizer(str(directory / "tokenizer.json")).tokenize("Hello world") == [15496, 995]


@pytest.mark.slow
def test_huggingface_tokenizer_with_bos_post_processor(tmp_path):
    from tokenizers import Tokenizer

    text = CORPUS.read_text(encoding="utf-8")
    directory = bos_tokenizer_dir(tmp_path / "bos", text[:100_000])
    library = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok = HuggingFaceTokenizer(str(directory))
    docs = text.split("\n\n")[:300]
    assert tok.tokenize_batch(docs) == [library.encode(d).ids for d in docs]
    assert tok.tokenize(text) == library.encode(text).ids
    ids = tok.tokenize("A hacker is")
    assert ids[0] == library.token_to_id("<s>") and tok.eod == library.token_to_id("</s>")
    assert tok.vocab_size == 600 and tok.detokenize(ids[1:]) == "A hacker is"


def test_huggingface_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="--tokenizer-model.*no such file"):
        HuggingFaceTokenizer(str(tmp_path))                 # a directory without tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a HuggingFace tokenizer.json"):
        HuggingFaceTokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="--tokenizer-model is required"):
        build_tokenizer("HuggingFaceTokenizer")
