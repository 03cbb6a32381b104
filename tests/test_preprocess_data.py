"""tools/preprocess_data.py and its engine: corpus round trip, workers, streaming splits, malformed
lines, bad input."""
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.data import GPT2_MERGES, GPT2_VOCAB
from helpers.hf_tokenizers import bos_tokenizer_dir

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.preprocess import PreprocessConfig, PreprocessError, preprocess, txt_batches
from megazero.data.sample import CORPUS, TOKENIZER_MODEL, sample_documents, sample_text
from megazero.data.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer

REPO = Path(__file__).resolve().parents[1]


def _gpt2_cfg(inp, out, **kw):
    return PreprocessConfig(input=str(inp), output_prefix=str(out), tokenizer_type="GPT2BPETokenizer",
                            vocab_file=str(GPT2_VOCAB), merge_file=str(GPT2_MERGES), **kw)


def _sp_cfg(inp, out, **kw):
    return PreprocessConfig(input=str(inp), output_prefix=str(out), tokenizer_type="SentencePieceTokenizer",
                            tokenizer_model=str(TOKENIZER_MODEL), **kw)


def _write_jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d}) + "\n")


@pytest.fixture(scope="module")
def corpus_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "jargon.jsonl"
    _write_jsonl(path, sample_documents())
    return path


def test_corpus_round_trip_gpt2_and_workers_agree(corpus_jsonl, tmp_path):
    docs = sample_documents()
    assert "\n\n".join(docs) == CORPUS.read_text(encoding="utf-8")
    logs = []
    res = preprocess(_gpt2_cfg(corpus_jsonl, tmp_path / "one", append_eod=True, batch_bytes=1 << 17), logs.append)
    assert res.documents == 1370 and res.tokens == 298_535 and not res.skipped
    assert any("processed 1,370 documents" in line and "MB/s" in line for line in logs)
    ds = IndexedDataset(res.outputs["text"])
    tok = GPT2BPETokenizer(str(GPT2_VOCAB), str(GPT2_MERGES))
    assert ds.dtype == np.uint16 and ds.num_documents == 1370
    for i, d in enumerate(docs):
        assert ds[i][-1] == tok.eod
        assert tok.detokenize(ds[i][:-1]) == d
    res2 = preprocess(_gpt2_cfg(corpus_jsonl, tmp_path / "two", append_eod=True, workers=2, batch_bytes=1 << 16),
                      logs.append)
    for ext in (".bin", ".idx"):
        assert Path(res2.outputs["text"] + ext).read_bytes() == Path(res.outputs["text"] + ext).read_bytes()


def test_sentencepiece_round_trip_plain_text(tmp_path):
    text = sample_text()
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    res = preprocess(_sp_cfg(tmp_path / "in.txt", tmp_path / "out", batch_bytes=4096), lambda s: None)
    paragraphs = [p for p in text.split("\n\n") if p]
    assert res.documents == len(paragraphs) == 8062
    ds, sp = IndexedDataset(res.outputs["text"]), SentencePieceTokenizer(str(TOKENIZER_MODEL))
    assert [sp.detokenize(ds[i]) for i in range(len(ds))] == paragraphs


def test_streaming_txt_split_equals_str_split(tmp_path):
    rng = random.Random(0)
    for trial in range(60):
        sep = rng.choice([b"\n\n", b"\n", b"@@@"])
        data = b"".join(rng.choice([b"a", b"bc", b"\n", b"\n\n", b"@", b"@@", b"x\n"]) for _ in range(rng.randint(0, 80)))
        (tmp_path / "t.txt").write_bytes(data)
        got = [d for batch in txt_batches(str(tmp_path / "t.txt"), rng.randint(1, 9), sep) for _, d in batch]
        assert got == [p for p in data.split(sep) if p], (data, sep)


def test_txt_line_numbers(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"a\nb\n\nc\n\n\n\nd")
    got = [x for batch in txt_batches(str(tmp_path / "t.txt"), 3, b"\n\n") for x in batch]
    assert got == [(1, b"a\nb"), (4, b"c"), (8, b"d")]


def test_malformed_lines_are_skipped_and_reported(tmp_path):
    lines = [b'{"text": "good one"}', b"{not json", b'{"other": "x"}', b'{"text": 3}', b"",
             b'["a list"]', b'{"text": "bad utf8 \xff"}', b'{"text": "good two"}']
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    logs = []
    res = preprocess(_sp_cfg(tmp_path / "in.jsonl", tmp_path / "out", append_eod=True), logs.append)
    assert res.documents == 2
    assert [n for n, _ in res.skipped] == [2, 3, 4, 5, 6, 7]
    reasons = dict(res.skipped)
    assert "invalid JSON" in reasons[2] and "missing key 'text'" in reasons[3] and "not a string" in reasons[4]
    assert "blank line" in reasons[5] and "JSON object" in reasons[6] and "JSON" in reasons[7]
    assert any("line 2" in s for s in logs) and any("skipped 6 malformed line(s)" in s for s in logs)
    ds, sp = IndexedDataset(res.outputs["text"]), SentencePieceTokenizer(str(TOKENIZER_MODEL))
    assert [sp.detokenize(ds[i]) for i in range(2)] == ["good one", "good two"]


def test_several_json_keys(tmp_path):
    with open(tmp_path / "in.jsonl", "w") as f:
        f.write(json.dumps({"text": "hello", "title": "T1"}) + "\n" + json.dumps({"text": "world", "title": "T2"}) + "\n")
    res = preprocess(_sp_cfg(tmp_path / "in.jsonl", tmp_path / "out", json_keys=("text", "title")), lambda s: None)
    sp = SentencePieceTokenizer(str(TOKENIZER_MODEL))
    for key, want in (("text", ["hello", "world"]), ("title", ["T1", "T2"])):
        assert res.outputs[key] == str(tmp_path / f"out_{key}_document")
        ds = IndexedDataset(res.outputs[key])
        assert [sp.detokenize(ds[i]) for i in range(2)] == want


def test_bad_input_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(PreprocessError, match="empty.jsonl' is empty"):
        preprocess(_sp_cfg(tmp_path / "empty.jsonl", tmp_path / "o"))
    with pytest.raises(PreprocessError, match="no such file"):
        preprocess(_sp_cfg(tmp_path / "missing.jsonl", tmp_path / "o"))
    (tmp_path / "junk.jsonl").write_bytes(b"junk\nmore junk\n")
    with pytest.raises(PreprocessError, match="no documents found \\(2 lines skipped"):
        preprocess(_sp_cfg(tmp_path / "junk.jsonl", tmp_path / "o"), lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "junk.jsonl"]   # nothing half-written
    with pytest.raises(PreprocessError, match="--output-prefix .* does not exist"):
        preprocess(_sp_cfg(tmp_path / "junk.jsonl", tmp_path / "nodir" / "o"))


def test_cli(tmp_path):
    _write_jsonl(tmp_path / "in.jsonl", ["first doc", "second doc"])
    tool = str(REPO / "tools" / "preprocess_data.py")
    args = [sys.executable, tool, "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "c"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(TOKENIZER_MODEL),
            "--append-eod", "--workers", "1"]
    run = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "processed 2 documents" in run.stderr and "c_text_document" in run.stdout
    assert IndexedDataset(str(tmp_path / "c_text_document")).num_documents == 2
    (tmp_path / "empty.txt").write_text("")
    run = subprocess.run(args[:3] + [str(tmp_path / "empty.txt")] + args[4:], capture_output=True, text=True)
    assert run.returncode == 2 and "is empty" in run.stderr


def test_huggingface_tokenizer_preprocessing_is_read_by_megatron(corpus_jsonl, tmp_path):
    """The whole corpus through a tokenizer.json (beginning-of-sequence token added per document,
    eod appended), with 2 workers: every document reads back, by us and by megatron-core."""
    import warnings

    directory = bos_tokenizer_dir(tmp_path / "tok", sample_text()[:200_000])
    cfg = PreprocessConfig(input=str(corpus_jsonl), output_prefix=str(tmp_path / "hf"),
                           tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory), append_eod=True,
                           workers=2, batch_bytes=1 << 17)
    res = preprocess(cfg)
    tok = HuggingFaceTokenizer(str(directory))
    docs = sample_documents()
    expected = [ids + [tok.eod] for ids in tok.tokenize_batch(docs)]
    assert res.documents == len(docs) and res.tokens == sum(map(len, expected))
    ours = IndexedDataset(res.outputs["text"])
    assert [ours[i].tolist() for i in range(len(docs))] == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                       reason="megatron-core is not installed; pip install megatron-core")
    theirs = megatron.IndexedDataset(res.outputs["text"])
    assert [theirs[i].tolist() for i in range(len(docs))] == expected
    assert tok.detokenize(theirs[5].tolist()[1:-1]) == docs[5]
