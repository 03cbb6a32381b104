"""GPT dataset: samples equal slices of the shuffled document stream, splits, epochs, blending
proportions, index caches (one writer), vocab check, mock data, DP sampling and exact resume."""
import os

import numpy as np
import pytest
import torch
from helpers import run_on_ranks

from megazero.config import DataConfig
from megazero.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    IndexCache,
    MockGPTDataset,
    build_blending_indices,
    build_sample_idx,
    build_train_valid_test_datasets,
    parse_data_path,
    split_ranges,
)
from megazero.data.indexed_dataset import IndexedDataset, write_indexed_dataset
from megazero.data.sample import default_sample, sample_documents, sample_tokenizer
from megazero.data.samplers import MicroBatchIterator, build_data_iterators, micro_batch_sample_ids, samples_to_batch
from megazero.errors import DataError


def _make(tmp_path, name="d", n_docs=50, seed=0, vocab=1000, max_len=40):
    """Documents whose tokens encode (doc id, position) so any sample can be checked by hand."""
    rng = np.random.default_rng(seed)
    docs = [list((d * 7 + np.arange(rng.integers(0, max_len))) % vocab) for d in range(n_docs)]
    docs[3] = []                                   # an empty document is harmless
    write_indexed_dataset(str(tmp_path / name), docs)
    return IndexedDataset(str(tmp_path / name)), docs


def test_worked_example():
    sizes = np.array([4, 3, 5])
    assert build_sample_idx(sizes, np.array([2, 0, 1]), 4, 2).tolist() == [[0, 0], [0, 4], [1, 3]]


@pytest.mark.parametrize("seq_length,num_samples", [(1, 30), (7, 100), (16, 500), (64, 40)])
def test_samples_are_slices_of_the_shuffled_stream(tmp_path, seq_length, num_samples):
    ds, docs = _make(tmp_path)
    g = GPTDataset(ds, (0, len(docs)), num_samples, seq_length, seed=5)
    stream = np.concatenate([docs[int(d)] for d in g.doc_idx]).astype(np.int64)
    assert len(g) >= num_samples
    for i in range(len(g)):
        j = int(g.shuffle_idx[i])
        assert np.array_equal(g[i], stream[j * seq_length: j * seq_length + seq_length + 1])
    # every epoch is a permutation of all documents
    epochs = g.doc_idx.reshape(-1, len(docs))
    assert all(sorted(e) == list(range(len(docs))) for e in epochs)
    assert sorted(g.shuffle_idx.tolist()) == list(range(len(g)))


def test_partial_last_epoch_is_shuffled_separately(tmp_path):
    ds, docs = _make(tmp_path)
    tokens = sum(len(d) for d in docs)
    seq = 8
    per_epoch = (tokens - 1) // seq
    n = 2 * per_epoch + per_epoch // 10               # needs a small part of a third epoch
    g = GPTDataset(ds, (0, len(docs)), n, seq, seed=1)
    assert len(g.doc_idx) == 3 * len(docs)
    full = (2 * tokens - 1) // seq
    assert sorted(g.shuffle_idx[:full].tolist()) == list(range(full))   # full epochs come first


def test_same_seed_same_order_other_seed_differs(tmp_path):
    ds, docs = _make(tmp_path)
    a, b = (GPTDataset(ds, (0, 50), 200, 16, seed=3) for _ in range(2))
    c = GPTDataset(ds, (0, 50), 200, 16, seed=4)
    assert all(np.array_equal(a[i], b[i]) for i in range(200))
    assert not all(np.array_equal(a[i], c[i]) for i in range(200))


def test_split_ranges_and_disjoint_splits(tmp_path):
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("8,2", 10) == [(0, 8), (8, 10), (10, 10)]
    ds, docs = _make(tmp_path, n_docs=100)
    cfg = DataConfig(data_path=[str(tmp_path / "d")], split="80,20,0", data_cache_path=None)
    tr, va, te = build_train_valid_test_datasets(cfg, seq_length=4, seed=1, num_samples=(50, 10, 5),
                                                 vocab_size=1000)
    assert te is None
    assert set(tr.doc_idx.tolist()) == set(range(80)) and set(va.doc_idx.tolist()) == set(range(80, 100))
    with pytest.raises(DataError, match="--split"):
        split_ranges("a,b", 10)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.2, 0.3], [0.01, 0.99], [1 / 3, 1 / 3, 1 / 3]])
def test_blending_order_tracks_weights_exactly(weights):
    which, local = build_blending_indices(weights, 10_000)
    counts = np.zeros(len(weights), int)
    for i, d in enumerate(which):                  # after every prefix, each count within 1 of target
        counts[d] += 1
        assert local[i] == counts[d] - 1
        assert np.all(np.abs(counts - np.array(weights) * (i + 1)) < 1.0 + 1e-9)
    assert np.all(np.abs(counts / 10_000 - weights) < 0.01)


def test_blended_dataset_from_data_path(tmp_path):
    _make(tmp_path, "a", seed=1)
    _make(tmp_path, "b", seed=2)
    cfg = DataConfig(data_path=["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")], split="1",
                     data_cache_path=str(tmp_path / "cache"))
    tr, va, te = build_train_valid_test_datasets(cfg, seq_length=8, seed=1, num_samples=(10_000, 0, 0))
    assert isinstance(tr, BlendedDataset) and va is None and te is None and len(tr) == 10_000
    assert np.bincount(tr.which).tolist() == [3000, 7000]
    for i in (0, 1, 2, 4999, 9999):                  # sample i is the right dataset's sample
        d, k = int(tr.which[i]), int(tr.local[i])
        assert np.array_equal(tr[i], tr.datasets[d][k])
    assert len(tr.datasets[0]) >= 3000 and len(tr.datasets[1]) >= 7000
    with pytest.raises(DataError, match="weight-prefix pairs"):
        parse_data_path(["0.3", "a", "0.7"])


def test_index_cache_written_once_and_reused(tmp_path, monkeypatch):
    ds, docs = _make(tmp_path)
    cache = IndexCache(str(tmp_path / "cache"))
    a = GPTDataset(ds, (0, 50), 300, 8, 1, cache)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    mtimes = [os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files]

    def boom(*args, **kw):
        raise AssertionError("rebuilt instead of loading the cache")
    monkeypatch.setattr(GPTDataset, "build_indices", boom)
    b = GPTDataset(ds, (0, 50), 300, 8, 1, IndexCache(str(tmp_path / "cache"), is_writer=False))
    assert isinstance(b.shuffle_idx, np.memmap)
    assert all(np.array_equal(a[i], b[i]) for i in range(300))
    assert [os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files] == mtimes


def _cache_body(rank, world, tmp, calls_file):
    import torch.distributed as dist

    from megazero.data.gpt_dataset import GPTDataset as G
    from megazero.data.gpt_dataset import IndexCache as C
    from megazero.data.indexed_dataset import IndexedDataset as I
    orig = G.build_indices

    def counting(self, *a):
        with open(calls_file, "a") as f:
            f.write(f"{rank}\n")
        return orig(self, *a)
    G.build_indices = counting
    try:
        g = G(I(os.path.join(tmp, "d")), (0, 50), 200, 8, 7, C(os.path.join(tmp, "cache"), rank == 0, dist.barrier))
    finally:
        G.build_indices = orig
    return np.stack([g[i] for i in range(0, 200, 13)])


def test_cache_built_by_one_rank_read_by_all(tmp_path):
    _make(tmp_path)
    out = run_on_ranks(2, _cache_body, str(tmp_path), str(tmp_path / "calls.txt"), timeout=120)
    assert np.array_equal(out[0], out[1])
    assert (tmp_path / "calls.txt").read_text() == "0\n"


def test_vocab_smaller_than_ids_in_data(tmp_path):
    _, docs = _make(tmp_path, vocab=1000)
    top = max(max(d, default=0) for d in docs)
    cfg = DataConfig(data_path=[str(tmp_path / "d")], data_cache_path=str(tmp_path / "c"))
    with pytest.raises(DataError, match=rf"d\.bin holds token id {top} but the tokenizer's vocab has only {top}"):
        build_train_valid_test_datasets(cfg, seq_length=8, seed=1, num_samples=(10, 0, 0), vocab_size=top)
    build_train_valid_test_datasets(cfg, seq_length=8, seed=1, num_samples=(10, 0, 0), vocab_size=top + 1)


def test_missing_data_and_too_small_split(tmp_path):
    with pytest.raises(DataError, match="--data-path .*nope.idx not found"):
        build_train_valid_test_datasets(DataConfig(data_path=[str(tmp_path / "nope")]), seq_length=8, seed=1,
                                        num_samples=(10, 0, 0))
    with pytest.raises(DataError, match="no data"):
        build_train_valid_test_datasets(DataConfig(), seq_length=8, seed=1, num_samples=(10, 0, 0))
    write_indexed_dataset(str(tmp_path / "tiny"), [[1, 2, 3]])
    with pytest.raises(DataError, match="too few for one sample of --seq-length 8"):
        GPTDataset(IndexedDataset(str(tmp_path / "tiny")), (0, 1), 5, 8, 1)


def test_mock_dataset():
    cfg = DataConfig(mock_data=True)
    tr, va, te = build_train_valid_test_datasets(cfg, seq_length=16, seed=3, num_samples=(100, 10, 0), vocab_size=97)
    assert te is None and len(tr) == 100 and len(va) == 10
    again = MockGPTDataset(100, 16, 97, 3)
    for i in range(100):
        assert tr[i].shape == (17,) and tr[i].dtype == np.int64 and tr[i].min() >= 0 and tr[i].max() < 97
        assert np.array_equal(tr[i], again[i])
    assert not np.array_equal(tr[0], va[0])


def test_micro_batch_ids_partition_the_global_batch():
    assert [m.tolist() for m in micro_batch_sample_ids(16, 2, 0, 2, 8)] == [[16, 17], [20, 21]]
    assert [m.tolist() for m in micro_batch_sample_ids(16, 2, 1, 2, 8)] == [[18, 19], [22, 23]]
    for mbs, dp, gbs in [(1, 1, 4), (2, 4, 16), (3, 2, 6)]:
        ids = np.concatenate([np.concatenate(micro_batch_sample_ids(100, mbs, r, dp, gbs)) for r in range(dp)])
        assert sorted(ids.tolist()) == list(range(100, 100 + gbs))
    with pytest.raises(ValueError, match="--global-batch-size 10 is not divisible"):
        micro_batch_sample_ids(0, 2, 0, 2, 10)


def test_shares_of_a_step_split_the_same_samples_whoever_takes_part():
    """Replica groups reading one data stream: with every group taking part, group g's share (g, G) is what
    dp rank g*dp + d read of the G x dp sharding; any count of groups (even or not) splits the same samples,
    each exactly once, taking every count-th micro-batch from its place."""
    mbs, dp, groups, group_batch = 2, 2, 3, 8                # 2 micro-batches per dp rank per group, 6 in all
    step = groups * group_batch
    for g in range(groups):
        for d in range(dp):
            got = micro_batch_sample_ids(40, mbs, d, dp, step, share=(g, groups))
            old = micro_batch_sample_ids(40, mbs, g * dp + d, groups * dp, step)
            assert [m.tolist() for m in got] == [m.tolist() for m in old]
    for count in (1, 2, 3, 4, 5):
        ids = [np.concatenate(micro_batch_sample_ids(40, mbs, d, dp, step, share=(p, count)))
               for p in range(count) for d in range(dp)]
        assert sorted(np.concatenate(ids).tolist()) == list(range(40, 40 + step))
    assert [m.tolist() for m in micro_batch_sample_ids(0, 1, 0, 1, 5, share=(1, 2))] == [[1], [3]]
    with pytest.raises(ValueError, match="share position 2 outside"):
        micro_batch_sample_ids(0, 1, 0, 1, 4, share=(2, 2))


def test_batch_format_and_eod_mask():
    samples = np.array([[5, 6, 0, 7, 8], [0, 1, 2, 3, 0]])
    b = samples_to_batch(samples)
    assert b["tokens"].dtype == torch.int64 and b["labels"].dtype == torch.int64
    assert b["loss_mask"].dtype == torch.float32 and b["tokens"].shape == (2, 4)
    assert b["tokens"].tolist() == [[5, 6, 0, 7], [0, 1, 2, 3]] and b["labels"].tolist() == [[6, 0, 7, 8], [1, 2, 3, 0]]
    assert b["loss_mask"].tolist() == [[1] * 4] * 2
    m = samples_to_batch(samples, eod=0, eod_mask_loss=True)["loss_mask"]
    assert m.tolist() == [[1, 1, 0, 1], [0, 1, 1, 1]]


def _steps(it, n):
    return [[{k: v.clone() for k, v in mb.items()} for mb in it.next_step()] for _ in range(n)]


def test_resume_continues_exactly(tmp_path):
    ds, docs = _make(tmp_path)
    g = GPTDataset(ds, (0, 50), 400, 8, seed=9)
    kw = dict(micro_batch_size=2, global_batch_size=8, dp_size=2)
    for rank in range(2):
        full = _steps(MicroBatchIterator(g, dp_rank=rank, **kw), 6)
        first = MicroBatchIterator(g, dp_rank=rank, **kw)
        _steps(first, 2)
        state = first.state_dict()
        assert state == {"consumed_samples": 16}
        resumed = MicroBatchIterator(g, dp_rank=rank, **kw)
        resumed.load_state_dict(state)
        rest = _steps(resumed, 4)
        for want, got in zip(full[2:], rest):
            for a, b in zip(want, got):
                assert all(torch.equal(a[k], b[k]) for k in a)
    # the two ranks of a step read different samples, together the global batch in order
    r0, r1 = (MicroBatchIterator(g, dp_rank=r, **kw).next_step() for r in range(2))
    assert torch.equal(r0[0]["tokens"][0], torch.from_numpy(g[0][:-1])) and torch.equal(r1[0]["tokens"][0], torch.from_numpy(g[2][:-1]))
    with pytest.raises(StopIteration, match="exhausted"):
        MicroBatchIterator(g, consumed_samples=len(g) - 4, **{**kw, "dp_size": 1}).next_step()


def test_default_sample_end_to_end(tmp_path):
    prefix = default_sample(tmp_path)
    assert default_sample(tmp_path) == prefix                  # idempotent
    ds, tok = IndexedDataset(prefix), sample_tokenizer()
    assert ds.num_documents == 1370 and ds.num_tokens == 329_013
    docs = sample_documents()
    for i in (0, 1, 700, 1369):
        assert ds[i][-1] == tok.eod and tok.detokenize(ds[i][:-1]) == docs[i]
    cfg = DataConfig(data_path=[prefix], tokenizer_type="SentencePieceTokenizer")
    tr, va, te = build_train_valid_test_datasets(cfg, seq_length=32, seed=1234, num_samples=(64, 8, 8),
                                                 vocab_size=tok.vocab_size)
    it = MicroBatchIterator(tr, micro_batch_size=4, global_batch_size=8, eod=tok.eod, eod_mask_loss=True)
    mb = it.next_step()[0]
    assert mb["tokens"].shape == (4, 32) and mb["tokens"].max() < 4000
    assert os.path.isdir(os.path.join(tmp_path, "cache", "GPTDataset_indices"))


def test_build_data_iterators_for_a_run(tmp_path):
    prefix = default_sample(tmp_path)
    tok = sample_tokenizer()
    cfg = DataConfig(data_path=[prefix], split="98,1,1", data_cache_path=str(tmp_path / "c"), eod_mask_loss=True)
    kw = dict(seq_length=16, seed=7, micro_batch_size=2, global_batch_size=8, dp_size=2, train_iters=10,
              eval_iters=2, eval_interval=5, vocab_size=tok.vocab_size, eod=tok.eod)
    its = [build_data_iterators(cfg, dp_rank=r, **kw) for r in range(2)]
    tr, va, te = its[0]
    assert len(tr.dataset) >= 80 and len(va.dataset) >= 3 * 2 * 8 and len(te.dataset) >= 16
    steps = [[it[0].next_step() for _ in range(3)] for it in its]
    resumed = build_data_iterators(cfg, dp_rank=1, consumed_train_samples=16, **kw)[0]
    assert torch.equal(resumed.next_step()[1]["tokens"], steps[1][2][1]["tokens"])
    assert not torch.equal(steps[0][0][0]["tokens"], steps[1][0][0]["tokens"])
    masks = torch.cat([mb["loss_mask"] for s in steps[0] for mb in s])
    toks = torch.cat([mb["tokens"] for s in steps[0] for mb in s])
    assert torch.equal(masks == 0, toks == tok.eod)


def test_a_batch_size_schedule_takes_each_steps_batch_and_sizes_the_split_to_hold_it():
    """A step trains at the batch of the samples consumed before it; a schedule whose batch falls back
    (16 then 8) still finds every sample its steps read: 16 + 8 + 8 > 3 steps x the last batch."""
    kw = dict(seq_length=16, seed=7, micro_batch_size=2, global_batch_size=8, dp_size=2, train_iters=3, eval_iters=0,
              eval_interval=5, vocab_size=97, eod=None)
    tr = build_data_iterators(DataConfig(mock_data=True), dp_rank=0,
                              batch_at=lambda consumed: 16 if consumed < 16 else 8, **kw)[0]
    assert len(tr.dataset) == 32
    assert [len(tr.next_step()) for _ in range(3)] == [4, 2, 2] and tr.consumed_samples == 32
    assert len(build_data_iterators(DataConfig(mock_data=True), dp_rank=0, **kw)[0].dataset) == 24


def _sample_body(rank, world, cache_dir):
    from megazero.data.sample import default_sample as ds_fn
    prefix = ds_fn(cache_dir)                      # both ranks at once, no coordination
    return prefix, IndexedDataset(prefix).num_tokens


def test_default_sample_concurrent_callers(tmp_path):
    out = run_on_ranks(2, _sample_body, str(tmp_path), timeout=120)
    assert out[0] == out[1] and out[0][1] == 329_013
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
