"""Megatron indexed dataset: round trips, compatibility with megatron-core both ways, clear errors
for corrupt / truncated / mismatched files."""
import struct
import warnings

import numpy as np
import pytest

from megazero.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    best_dtype,
    write_indexed_dataset,
)

DOCS = [[5, 6, 7], [8, 9], [], [1] * 10, list(range(300, 320))]


def _read_all(ds):
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    docs = DOCS if dtype != np.uint8 else [d for d in DOCS if max(d, default=0) < 256]
    write_indexed_dataset(str(tmp_path / "d"), docs, dtype)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.dtype == np.dtype(dtype)
    assert _read_all(ds) == docs and ds.num_documents == len(docs)
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    if dtype != np.uint8:
        assert ds.get(4, 3, 2).tolist() == [303, 304]
    assert ds.max_token_id() == max(max(d, default=-1) for d in docs)


def test_header_layout_is_megatron(tmp_path):
    write_indexed_dataset(str(tmp_path / "d"), [[5, 6, 7], [8, 9]], np.uint16)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 2, 3)
    assert np.frombuffer(raw[34:42], np.int32).tolist() == [3, 2]
    assert np.frombuffer(raw[42:58], np.int64).tolist() == [0, 6]
    assert np.frombuffer(raw[58:], np.int64).tolist() == [0, 1, 2]
    assert (tmp_path / "d.bin").read_bytes() == np.array([5, 6, 7, 8, 9], "<u2").tobytes()


def test_multi_sequence_documents_and_batch_add(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "d"), np.int32) as w:
        w.add_item([1, 2]); w.add_item([3]); w.end_document()
        w.add_documents(np.array([4, 5, 6, 7]), np.array([1, 0, 3]))
    ds = IndexedDataset(str(tmp_path / "d"))
    assert _read_all(ds) == [[1, 2], [3], [4], [], [5, 6, 7]]
    assert ds.document_indices.tolist() == [0, 2, 3, 4, 5]


def test_empty_dataset(tmp_path):
    write_indexed_dataset(str(tmp_path / "d"), [])
    ds = IndexedDataset(str(tmp_path / "d"))
    assert len(ds) == 0 and ds.num_documents == 0 and ds.max_token_id() == -1


def test_best_dtype():
    assert best_dtype(50257) == np.uint16 and best_dtype(65500) == np.int32 and best_dtype(128256) == np.int32


def test_writer_rejects_ids_that_do_not_fit_and_cleans_up(tmp_path):
    with pytest.raises(IndexedDatasetError, match="does not fit the file dtype uint16"):
        with IndexedDatasetWriter(str(tmp_path / "d"), np.uint16) as w:
            w.add_document([70000])
    assert list(tmp_path.iterdir()) == []          # no partial files left behind


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, DOCS, np.uint16)
    return prefix


def _patch(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


def test_wrong_magic(good):
    _patch(good + ".idx", 0, b"NOTMAGIC!")
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: wrong magic"):
        IndexedDataset(good)


def test_wrong_version(good):
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match="version 2 is not supported"):
        IndexedDataset(good)


@pytest.mark.parametrize("code", [6, 7, 9, 0])
def test_bad_dtype_code(good, code):
    _patch(good + ".idx", 17, bytes([code]))
    with pytest.raises(IndexedDatasetError, match=f"dtype code {code}"):
        IndexedDataset(good)


def test_truncated_bin(good):
    raw = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(raw[:-4])
    with pytest.raises(IndexedDatasetError, match=r"d\.bin: data file is 66 bytes but .*d\.idx describes 70 \(truncated"):
        IndexedDataset(good)


def test_bin_with_extra_bytes(good):
    open(good + ".bin", "ab").write(b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match="extra bytes"):
        IndexedDataset(good)


def test_truncated_and_empty_idx(good):
    raw = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(raw[:-8])
    with pytest.raises(IndexedDatasetError, match="truncated or corrupt"):
        IndexedDataset(good)
    open(good + ".idx", "wb").write(b"")
    with pytest.raises(IndexedDatasetError, match="shorter than the 34-byte header"):
        IndexedDataset(good)


def test_corrupt_pointers_and_missing_files(good, tmp_path):
    _patch(good + ".idx", 34 + 4 * len(DOCS) + 8, struct.pack("<q", 2))
    with pytest.raises(IndexedDatasetError, match="running sum"):
        IndexedDataset(good)
    with pytest.raises(IndexedDatasetError, match="index file not found"):
        IndexedDataset(str(tmp_path / "missing"))
    write_indexed_dataset(str(tmp_path / "e"), DOCS)
    (tmp_path / "e.bin").unlink()
    with pytest.raises(IndexedDatasetError, match="data file not found"):
        IndexedDataset(str(tmp_path / "e"))


@pytest.fixture(scope="module")
def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.datasets import indexed_dataset
        except ImportError as e:
            pytest.skip(f"megatron-core is not installed ({e}); pip install megatron-core")
    return indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_ours_read_by_megatron(tmp_path, megatron, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, rng.integers(0, 50)).tolist() for _ in range(40)]
    write_indexed_dataset(str(tmp_path / "d"), docs, dtype)
    theirs = megatron.IndexedDataset(str(tmp_path / "d"))
    assert len(theirs) == len(docs) and theirs.index.dtype == dtype
    assert [theirs[i].tolist() for i in range(len(docs))] == docs
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
    assert theirs.get(3, offset=1, length=2).tolist() == docs[3][1:3]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_read_by_ours(tmp_path, megatron, dtype):
    import torch
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50000, rng.integers(0, 50)).tolist() for _ in range(40)]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for d in docs:
        builder.add_item(torch.tensor(d, dtype=torch.int64))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(str(tmp_path / "m"))
    assert ours.dtype == dtype and _read_all(ours) == docs
    assert ours.document_indices.tolist() == list(range(len(docs) + 1))


def test_pointer_check_in_chunks(good):
    from megazero.data.indexed_dataset import pointers_consistent
    ds = IndexedDataset(good)
    lengths, pointers = np.asarray(ds.sequence_lengths), np.asarray(ds.sequence_pointers).copy()
    for chunk in (1, 2, 3, 100):
        assert pointers_consistent(lengths, pointers, 2, chunk)
        bad = pointers.copy()
        bad[-1] += 2
        assert not pointers_consistent(lengths, bad, 2, chunk)
