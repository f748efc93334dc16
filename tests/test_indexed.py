"""Megatron-LM MMapIndexedDataset files (``jaxtron.data.indexed``) and the ``jaxtron.data.prepare`` CLI."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from jaxtron.data import prepare
from jaxtron.data.indexed import (IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, best_dtype,
                                  merge)
from jaxtron.data.tokenizers import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- an independent implementation of the layout, written from the format description only -----------------
SPEC_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
              np.uint16: 8}
SPEC_DTYPES = {v: k for k, v in SPEC_CODES.items()}


def spec_write(prefix, docs, dtype):
    sizes = np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
    lens = [len(d) for d in docs]
    offs, pos = [], 0
    for n in lens:
        offs.append(pos)
        pos += n * sizes
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", SPEC_CODES[dtype]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(struct.pack(f"<{len(docs)}i", *lens))
        f.write(struct.pack(f"<{len(docs)}q", *offs))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


def spec_read(prefix):
    with open(f"{prefix}.idx", "rb") as f:
        buf = f.read()
    assert buf[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", buf, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", buf, 17)
    n, m = struct.unpack_from("<QQ", buf, 18)
    pos = 34
    lens = struct.unpack_from(f"<{n}i", buf, pos)
    pos += 4 * n
    offs = struct.unpack_from(f"<{n}q", buf, pos)
    pos += 8 * n
    docidx = struct.unpack_from(f"<{m}q", buf, pos)
    pos += 8 * m
    assert pos == len(buf)
    dtype = np.dtype(SPEC_DTYPES[code]).newbyteorder("<")
    with open(f"{prefix}.bin", "rb") as f:
        data = f.read()
    docs = [np.frombuffer(data, dtype=dtype, count=ln, offset=o) for ln, o in zip(lens, offs)]
    return SPEC_DTYPES[code], docs, list(docidx)


def random_docs(dtype, seed=0, n=7):
    rng = np.random.default_rng(seed)
    lens = [0, 1, 5, 33, 2, 100, 3][:n]
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return [rng.integers(info.min, int(info.max) + 1, size=k, dtype=np.int64).astype(dtype) for k in lens]
    return [rng.standard_normal(k).astype(dtype) for k in lens]


ALL_DTYPES = list(SPEC_CODES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda t: np.dtype(t).name)
def test_round_trip_every_dtype(tmp_path, dtype):
    docs = random_docs(dtype)
    w = IndexedDatasetWriter(tmp_path / "ds", dtype)
    for d in docs:
        w.add_document(d)
    assert not (tmp_path / "ds.idx").exists()  # .idx appears only at finalize
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]  # no temporary files left
    ds = IndexedDataset(tmp_path / "ds")
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    np.testing.assert_array_equal(ds.sequence_lengths, [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        assert ds[i].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ds.get(5, offset=10, length=7), docs[5][10:17])
    np.testing.assert_array_equal(ds.get(5, offset=95), docs[5][95:])
    np.testing.assert_array_equal(ds[-1], docs[-1])
    with pytest.raises(IndexError):
        ds[len(docs)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.float32], ids=lambda t: np.dtype(t).name)
def test_independent_layout_both_ways(tmp_path, dtype):
    docs = random_docs(dtype, seed=1)
    spec_write(tmp_path / "spec", docs, dtype)
    ds = IndexedDataset(tmp_path / "spec")
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))

    with IndexedDatasetWriter(tmp_path / "ours", dtype) as w:
        for d in docs:
            w.add_document(d)
    got_dtype, got_docs, docidx = spec_read(tmp_path / "ours")
    assert got_dtype is dtype and docidx == list(range(len(docs) + 1))
    for a, b in zip(got_docs, docs):
        np.testing.assert_array_equal(a, b)
    # byte-identical files
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"spec.{ext}").read_bytes()


def test_best_dtype():
    assert best_dtype(256) is np.uint16 and best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32 and best_dtype(128256) is np.int32


def test_merge(tmp_path):
    parts = [random_docs(np.uint16, seed=s, n=n) for s, n in ((0, 3), (1, 7), (2, 1))]
    for k, docs in enumerate(parts):
        spec_write(tmp_path / f"p{k}", docs, np.uint16)
    merge([tmp_path / f"p{k}" for k in range(3)], tmp_path / "all")
    ds = IndexedDataset(tmp_path / "all")
    flat = [d for docs in parts for d in docs]
    assert len(ds) == len(flat)
    for i, d in enumerate(flat):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(flat) + 1))
    _, docs, _ = spec_read(tmp_path / "all")
    assert len(docs) == len(flat)

    spec_write(tmp_path / "other", random_docs(np.int32, n=2), np.int32)
    with pytest.raises(IndexedDatasetError, match=r"other\.idx.*dtype int32"):
        IndexedDatasetWriter.merge([tmp_path / "p0", tmp_path / "other"], tmp_path / "bad")
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.idx").exists()


def _good(tmp_path):
    spec_write(tmp_path / "ds", random_docs(np.uint16), np.uint16)
    return tmp_path / "ds"


def _truncate(path, nbytes):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - nbytes])


@pytest.mark.parametrize("case,file,pattern", [
    ("truncated_bin", "ds.bin", "too short"),
    ("truncated_idx", "ds.idx", "truncated"),
    ("truncated_idx_header", "ds.idx", "truncated"),
    ("wrong_magic", "ds.idx", "magic"),
    ("wrong_version", "ds.idx", "version 2"),
    ("unknown_dtype", "ds.idx", "unknown dtype code 9"),
    ("missing_bin", "ds.bin", "cannot read"),
    ("missing_idx", "ds.idx", "cannot read"),
    ("bad_offset", "ds.bin", "too short"),
])
def test_bad_files_name_the_file(tmp_path, case, file, pattern):
    prefix = _good(tmp_path)
    idx, binf = tmp_path / "ds.idx", tmp_path / "ds.bin"
    raw = bytearray(idx.read_bytes())
    if case == "truncated_bin":
        _truncate(binf, 3)
    elif case == "truncated_idx":
        _truncate(idx, 8)
    elif case == "truncated_idx_header":
        idx.write_bytes(bytes(raw[:20]))
    elif case == "wrong_magic":
        raw[:9] = b"NOTMAGIC\x00"
        idx.write_bytes(bytes(raw))
    elif case == "wrong_version":
        raw[9:17] = struct.pack("<Q", 2)
        idx.write_bytes(bytes(raw))
    elif case == "unknown_dtype":
        raw[17] = 9
        idx.write_bytes(bytes(raw))
    elif case == "missing_bin":
        binf.unlink()
    elif case == "missing_idx":
        idx.unlink()
    elif case == "bad_offset":
        n = 7
        off = 34 + 4 * n + 8 * (n - 1)  # last sequence's byte offset
        raw[off:off + 8] = struct.pack("<q", 10_000)
        idx.write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError) as ei:
        IndexedDataset(prefix)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert str(tmp_path / file) in msg and pattern in msg, msg


# --- prepare CLI --------------------------------------------------------------------------------------------

DOCS = ["Hello world, this is the first document.\nWith two lines.",
        "Second doc: naïve café ünïcode — ok.",
        "third",
        "def f(x):\n    return x + 1\n"]


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS * 20, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _write_inputs(d):
    jl = d / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[:2])) + "\n")
    gz = d / "b.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": DOCS[2]}) + "\n")
    txt = d / "c.txt"
    txt.write_text(DOCS[3], encoding="utf-8")
    return [str(jl), str(gz), str(txt)]


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
@pytest.mark.parametrize("append_eod", [False, True])
def test_prepare_in_process(tmp_path, hf_tokenizer_json, tokenizer, append_eod, capsys):
    spec = "byte" if tokenizer == "byte" else hf_tokenizer_json
    inputs = _write_inputs(tmp_path)
    argv = ["--input", *inputs, "--output-prefix", str(tmp_path / "out"), "--tokenizer", spec, "--no-progress"]
    if append_eod:
        argv.append("--append-eod")
    assert prepare.main(argv) == 0
    assert "MB/s" in capsys.readouterr().out
    tok = load_tokenizer(spec)
    ds = IndexedDataset(tmp_path / "out")
    assert ds.dtype == np.uint16 and len(ds) == len(DOCS)
    for i, text in enumerate(DOCS):
        want = list(tok.encode(text)) + ([tok.eod] if append_eod else [])
        assert ds[i].tolist() == want
        if not append_eod:
            assert tok.decode(ds[i]) == text
    if tokenizer == "byte":
        assert tok.eod == 0 and tok.vocab_size == 256
        assert bytes(ds[1].astype(np.uint8)) == DOCS[1].encode() + (b"\x00" if append_eod else b"")


def test_prepare_subprocess_two_workers(tmp_path, hf_tokenizer_json):
    inputs = _write_inputs(tmp_path)
    # many documents, so both workers get tasks
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"content": f"document {i} " + "x" * (i % 700)}) + "\n")
    out = tmp_path / "sub"
    r = subprocess.run([sys.executable, "-m", "jaxtron.data.prepare", "--input", str(big), "--output-prefix",
                        str(out), "--tokenizer", hf_tokenizer_json, "--json-key", "content", "--append-eod",
                        "--workers", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    # stderr is a pipe here: no progress bar (it is drawn only on a terminal), so no carriage-return frames
    assert "MB/s" in r.stdout and "tokenizing" not in r.stderr and "\r" not in r.stderr
    tok = load_tokenizer(hf_tokenizer_json)
    ds = IndexedDataset(out)
    assert len(ds) == 3000
    for i in (0, 1, 1499, 2999):
        assert ds[i].tolist() == tok.encode(f"document {i} " + "x" * (i % 700)) + [tok.eod]
    # the same inputs through one worker give byte-identical files
    assert prepare.main(["--input", str(big), "--output-prefix", str(tmp_path / "one"), "--tokenizer",
                         hf_tokenizer_json, "--json-key", "content", "--append-eod", "--no-progress"]) == 0
    for ext in ("bin", "idx"):
        assert (tmp_path / f"one.{ext}").read_bytes() == (tmp_path / f"sub.{ext}").read_bytes()
    del inputs


def _run_bad(tmp_path, capsys, inputs, *extra):
    code = prepare.main(["--input", *map(str, inputs), "--output-prefix", str(tmp_path / "bad"),
                         "--tokenizer", "byte", "--no-progress", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.idx").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    return err[0]


def test_prepare_bad_inputs(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert str(missing) in _run_bad(tmp_path, capsys, [missing])

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n')
    line = _run_bad(tmp_path, capsys, [bad_json])
    assert f"{bad_json}:3:" in line and "invalid JSON" in line

    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"text": "ok"}\n{"body": "x"}\n')
    line = _run_bad(tmp_path, capsys, [no_key])
    assert f"{no_key}:2:" in line and "'text'" in line
    line = _run_bad(tmp_path, capsys, [no_key], "--json-key", "body")
    assert f"{no_key}:1:" in line and "'body'" in line

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    line = _run_bad(tmp_path, capsys, [empty])
    assert str(empty) in line and "empty" in line

    bad_tok = tmp_path / "missing_tokenizer.json"
    line = _run_bad(tmp_path, capsys, [no_key], "--tokenizer", str(bad_tok))
    assert str(bad_tok) in line


def test_prepare_bad_input_subprocess_exit_2(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\nnot json\n')
    r = subprocess.run([sys.executable, "-m", "jaxtron.data.prepare", "--input", str(bad_json),
                        "--output-prefix", str(tmp_path / "o"), "--tokenizer", "byte", "--workers", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [errors[0]] and f"{bad_json}:2:" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(DOCS * 30))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", minloglevel=2)
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert tok.vocab_size == 60 and tok.eod == 2
    assert tok.decode(tok.encode("third")) == "third"
    bad = tmp_path / "broken.model"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="broken.model"):
        load_tokenizer(str(bad))
