"""Megatron-style GPTDataset index building, caching, sample reading and dataset blending."""

import os
import time

import numpy as np
import pytest

from jaxtron.data.blending import BlendedDataset, build_blend_index, parse_data_paths, samples_per_dataset
from jaxtron.data.gpt_dataset import (GPTDataset, build_sample_index, cache_paths, make_batch_fields,
                                      split_documents)
from jaxtron.data.indexed import IndexedDataset, IndexedDatasetWriter


def _write(prefix, docs, dtype=np.uint16):
    w = IndexedDatasetWriter(str(prefix), dtype)
    for d in docs:
        w.add_document(np.asarray(d))
    w.finalize()
    return str(prefix)


def _docs(n=50, seed=0, lo=1, hi=40, eod=0):
    rng = np.random.RandomState(seed)
    docs = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        docs.append(np.concatenate([rng.randint(1, 1000, size=k - 1), [eod]]).astype(np.uint16))
    return docs


def _reference_tokens(docs, ds: GPTDataset, j):
    """Brute force: concatenate the documents in document_index order, cut window j (unshuffled)."""
    stream = np.concatenate([docs[int(d)] for d in ds.document_index])
    s = ds.seq_len
    return stream[j * s:(j + 1) * s + 1]


def test_samples_are_windows_of_shuffled_stream(tmp_path):
    docs = _docs(60)
    prefix = _write(tmp_path / "d", docs)
    for seq_len, n in ((7, 200), (16, 150), (1, 50)):
        ds = GPTDataset(prefix, (0, 60), seq_len, n, seed=3)
        total = sum(len(d) for d in docs) * ds.index.num_epochs
        assert len(ds) == (total - 1) // seq_len >= n  # every sample of the epochs, shuffled
        for i in range(n):
            j = int(ds.shuffle_index[i])
            ref = _reference_tokens(docs, ds, j)
            np.testing.assert_array_equal(ds.tokens(i), ref)
            item = ds[i]
            np.testing.assert_array_equal(item["inputs"], ref[:-1].astype(np.int32))
            np.testing.assert_array_equal(item["targets"], ref[1:].astype(np.int32))
            assert item["inputs"].dtype == np.int32 and item["loss_mask"].dtype == np.float32
            assert item["inputs"].shape == (seq_len,)
        assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))


def test_zero_length_documents(tmp_path):
    docs = [np.array([5, 6, 0]), np.array([], np.uint16), np.array([7, 0]), np.array([], np.uint16),
            np.array([1, 2, 3, 4, 0])]
    prefix = _write(tmp_path / "z", docs)
    ds = GPTDataset(prefix, (0, 5), 3, 20, seed=0)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds.tokens(i), _reference_tokens(docs, ds, int(ds.shuffle_index[i])))


def test_epochs_reshuffle():
    lengths = np.full(100, 10)
    idx = build_sample_index(lengths, np.arange(100), 10, 350, seed=1)  # 3501 tokens -> 4 epochs
    assert idx.num_epochs == 4
    # Megatron shuffles all epochs as one array (the last one is used 0.5%: shuffled on its own after them)
    assert idx.separate_final_epoch
    np.testing.assert_array_equal(np.bincount(idx.document_index[:300]), np.full(100, 3))
    assert sorted(idx.document_index[300:].tolist()) == list(range(100))
    assert any(sorted(e.tolist()) != list(range(100)) for e in idx.document_index[:300].reshape(3, 100))
    # exactly enough epochs: one fewer would not hold num_samples * seq_len + 1 tokens
    assert build_sample_index(lengths, np.arange(100), 10, 99, 1).num_epochs == 1
    assert build_sample_index(lengths, np.arange(100), 10, 100, 1).num_epochs == 2


def test_deterministic_and_cache(tmp_path):
    docs = _docs(40, seed=1)
    prefix = _write(tmp_path / "c", docs)
    a = build_sample_index([len(d) for d in docs], np.arange(40), 8, 100, 5)
    b = build_sample_index([len(d) for d in docs], np.arange(40), 8, 100, 5)
    for k in ("document_index", "sample_index", "shuffle_index"):
        assert getattr(a, k).tobytes() == getattr(b, k).tobytes()
    d1 = GPTDataset(prefix, (0, 40), 8, 100, seed=5)
    assert not d1.from_cache
    paths = cache_paths(prefix, (0, 40), 8, 100, 5)
    assert all(os.path.exists(p) for p in paths.values())
    assert all(os.path.dirname(p) == prefix + "_cache" for p in paths.values())
    d2 = GPTDataset(prefix, (0, 40), 8, 100, seed=5)
    assert d2.from_cache
    for k in ("document_index", "sample_index", "shuffle_index"):
        assert np.asarray(getattr(d1, k)).tobytes() == np.asarray(getattr(d2, k)).tobytes()
        assert np.asarray(getattr(d1, k)).tobytes() == getattr(a, k).tobytes()
    for i in range(len(d1)):
        np.testing.assert_array_equal(d1.tokens(i), d2.tokens(i))
    names = {os.path.basename(p) for p in paths.values()}
    for other in (cache_paths(prefix, (0, 40), 9, 100, 5), cache_paths(prefix, (0, 40), 8, 100, 6),
                  cache_paths(prefix, (0, 39), 8, 100, 5), cache_paths(prefix, (0, 40), 8, 101, 5)):
        assert not names & {os.path.basename(p) for p in other.values()}
    assert not any(f.endswith(".tmp" + str(os.getpid())) for f in os.listdir(prefix + "_cache"))
    # a different seed gives a different order
    d3 = GPTDataset(prefix, (0, 40), 8, 100, seed=6)
    assert d3.shuffle_index.tobytes() != d1.shuffle_index.tobytes()


def test_split_documents():
    assert split_documents(1000, "969,30,1") == {"train": (0, 969), "valid": (969, 999), "test": (999, 1000)}
    assert split_documents(10, "1") == {"train": (0, 10), "valid": None, "test": None}  # weight 0: none
    assert split_documents(10, "50,50") == {"train": (0, 5), "valid": (5, 10), "test": None}
    for n in (0, 1, 7, 99, 12345):
        r = split_documents(n, "98,2,0")
        assert r["train"][0] == 0 and r["valid"][1] == n and r["test"] is None
        assert r["train"][1] == r["valid"][0]
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,0,0", ""):
        with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
            split_documents(100, bad)


def test_split_datasets_disjoint(tmp_path):
    docs = [np.full(5, i + 1, np.uint16) for i in range(100)]
    prefix = _write(tmp_path / "s", docs)
    ranges = split_documents(100, "80,15,5")
    seen = {}
    for name, r in ranges.items():
        ds = GPTDataset(prefix, r, 4, 20, seed=0)
        seen[name] = set(np.concatenate([ds.tokens(i) for i in range(len(ds))]).tolist())
        assert seen[name] <= set(range(r[0] + 1, r[1] + 1))
    assert not seen["train"] & seen["valid"] and not seen["valid"] & seen["test"]


def test_reset_and_eod_options():
    win = np.array([[3, 4, 0, 5, 6, 0, 7, 8]])
    plain = make_batch_fields(win)
    np.testing.assert_array_equal(plain["positions"][0], np.arange(7))
    np.testing.assert_array_equal(plain["segment_ids"][0], np.ones(7))
    np.testing.assert_array_equal(plain["loss_mask"][0], np.ones(7))
    f = make_batch_fields(win, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, eod_id=0)
    np.testing.assert_array_equal(f["inputs"][0], [3, 4, 0, 5, 6, 0, 7])
    np.testing.assert_array_equal(f["positions"][0], [0, 1, 2, 0, 1, 2, 0])
    np.testing.assert_array_equal(f["segment_ids"][0], [1, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(f["loss_mask"][0], [1, 1, 0, 1, 1, 0, 1])  # where the INPUT is EOD
    g = make_batch_fields(win, reset_position_ids=True)
    np.testing.assert_array_equal(g["segment_ids"][0], np.ones(7))
    np.testing.assert_array_equal(g["positions"][0], [0, 1, 2, 0, 1, 2, 0])
    h = make_batch_fields(np.array([[3, 9, 4, 9, 5]]), reset_attention_mask=True, eod_id=9)
    np.testing.assert_array_equal(h["segment_ids"][0], [1, 1, 2, 2])
    np.testing.assert_array_equal(h["positions"][0], np.arange(4))
    for v in f.values():
        assert v.shape == (1, 7)


def test_dataset_options_applied(tmp_path):
    docs = _docs(30, seed=2)
    prefix = _write(tmp_path / "o", docs)
    ds = GPTDataset(IndexedDataset(prefix), (0, 30), 12, 40, seed=0, reset_position_ids=True,
                    reset_attention_mask=True, eod_mask_loss=True, eod_id=0)
    for i in range(len(ds)):
        ref = make_batch_fields(ds.tokens(i)[None], True, True, True, 0)
        item = ds[i]
        for k in ref:
            np.testing.assert_array_equal(item[k], ref[k][0])
        assert (item["loss_mask"][item["inputs"] == 0] == 0).all()


def test_large_synthetic_index_fast():
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 2000, size=100_000)  # ~1e8 tokens
    assert lengths.sum() >= 1e8
    seq_len = 2048
    num_samples = int(1e8) // seq_len
    t = time.perf_counter()
    idx = build_sample_index(lengths, np.arange(len(lengths)), seq_len, num_samples, seed=1)
    dt = time.perf_counter() - t
    assert dt < 20, dt
    # spot-check: every sample start is the token i * seq_len of the shuffled stream
    ends = np.cumsum(lengths[idx.document_index])
    starts = ends - lengths[idx.document_index]
    pos, off = idx.sample_index[:, 0], idx.sample_index[:, 1]
    np.testing.assert_array_equal(starts[pos] + off, np.arange(len(idx.sample_index)) * seq_len)
    assert len(idx) >= num_samples
    assert (off >= 0).all() and (off < lengths[idx.document_index[pos]]).all()


def test_multi_process_batches_match(tmp_path):
    docs = _docs(80, seed=4)
    prefix = _write(tmp_path / "m", docs)
    ds = GPTDataset(prefix, (0, 80), 10, 64, seed=2)
    gb = 8
    for step in range(len(ds) // gb):
        rows = np.arange(step * gb, (step + 1) * gb)
        single = ds.batch(rows)
        for procs in (1, 2, 4):
            # each process builds its own index (here: loads it from the cache) and reads only its rows
            parts = []
            for p in range(procs):
                local = GPTDataset(prefix, (0, 80), 10, 64, seed=2)
                parts.append(local.batch(rows[p * gb // procs:(p + 1) * gb // procs]))
            for k in single:
                np.testing.assert_array_equal(np.concatenate([q[k] for q in parts]), single[k])


def _check_windows(di, weights, window=10_000):
    k = len(weights)
    onehot = np.zeros((len(di) + 1, k), np.int64)
    onehot[1:][np.arange(len(di)), di] = 1
    cum = np.cumsum(onehot, axis=0)
    counts = cum[window:] - cum[:-window]  # every window of `window` consecutive samples
    frac = counts / window
    assert np.abs(frac - np.asarray(weights)[None]).max() <= 0.005


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.5, 0.3], [0.1, 0.1, 0.25, 0.55]])
def test_blend_proportions_and_determinism(weights):
    di, dsi = build_blend_index(weights, 100_000)
    _check_windows(di, weights)
    di2, dsi2 = build_blend_index(weights, 100_000)
    assert di.tobytes() == di2.tobytes() and dsi.tobytes() == dsi2.tobytes()
    for d in range(len(weights)):
        np.testing.assert_array_equal(dsi[di == d], np.arange((di == d).sum()))


def test_blend_greedy_rule():
    w = np.array([0.25, 0.45, 0.3])
    di, _ = build_blend_index(w, 500)
    counts = np.zeros(3)
    for i in range(500):
        err = w * max(i, 1) - counts  # Megatron's max(sample_idx, 1.0)
        assert di[i] == int(np.argmax(err))
        counts[di[i]] += 1


def test_blended_dataset(tmp_path):
    a = list(range(100))
    b = [1000 + i for i in range(100)]
    bl = BlendedDataset([a, b], [1, 3], 100)
    assert len(bl) == 100
    vals = [bl[i] for i in range(100)]
    assert sum(v < 1000 for v in vals) == 25
    assert [v for v in vals if v < 1000] == list(range(25))
    assert samples_per_dataset([0.25, 0.75], 100, 0.005) == [26, 76]  # ceil(ceil(size * w) * 1.005)
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([a[:10], b], [1, 3], 100)


def test_parse_data_paths():
    assert parse_data_paths("/data/x_text_document") == [(1.0, "/data/x_text_document")]
    r = parse_data_paths("0.3 A 0.7 B")
    assert [p for _, p in r] == ["A", "B"] and np.allclose([w for w, _ in r], [0.3, 0.7])
    r = parse_data_paths("3 A 1 B")
    assert np.allclose([w for w, _ in r], [0.75, 0.25])
    assert parse_data_paths("A B") == [(0.5, "A"), (0.5, "B")]
    with pytest.raises(ValueError, match="'0.3'"):
        parse_data_paths("0.3 A B")
    with pytest.raises(ValueError, match="'abc'"):
        parse_data_paths("abc A 0.5 B")
    with pytest.raises(ValueError, match="'-1'"):
        parse_data_paths("-1 A 2 B")
    with pytest.raises(ValueError, match="zero"):
        parse_data_paths("0 A 0 B")
    with pytest.raises(ValueError, match="'0.5'"):
        parse_data_paths("0.5")
    with pytest.raises(ValueError):
        parse_data_paths("")
