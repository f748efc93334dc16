"""Training from Megatron .bin/.idx files (a weighted blend) through ``python -m jaxtron.train``."""

import json

import numpy as np
import pytest

from jaxtron.data.indexed import IndexedDatasetWriter
from jaxtron.data.builtin import stdlib_files
from jaxtron.train.__main__ import main


def write_prefix(path, files, dtype=np.uint16):
    with IndexedDatasetWriter(str(path), dtype) as w:
        for f in files:
            data = open(f, "rb").read()
            w.add_document(np.concatenate([np.frombuffer(data, np.uint8), [0]]).astype(dtype))
        w.finalize()
    return str(path)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    files = stdlib_files()
    return write_prefix(d / "a", files[:300]), write_prefix(d / "b", files[300:600], np.int32)


def common(out):
    return ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1",
            "model.intermediate_size=128", "data.seq_len=64", "train.steps=30", "train.eval_every=0",
            "logging.log_every=10", "logging.progress=false", f"train.output_dir={out}",
            "optim.warmup_steps=5"]


def test_train_on_a_blend(prefixes, tmp_path):
    a, b = prefixes
    out = tmp_path / "run"
    overrides = common(out) + ["data.source=indexed", f"data.paths=0.3 {a} 0.7 {b}", "data.reset_at_eod=true"]
    assert main(overrides) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0] - 0.5


@pytest.mark.parametrize("paths,field", [
    ("0.5 {a} 0.5", "data.paths"),
    ("0.5 {a} x {b}", "data.paths"),
    ("{a}_missing", "data.paths"),
])
def test_bad_data_paths(prefixes, tmp_path, capsys, paths, field):
    a, b = prefixes
    overrides = common(tmp_path) + ["data.source=indexed", "data.paths=" + paths.format(a=a, b=b)]
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip()  # log lines may come first; then one error line, no traceback
    assert err.splitlines()[-1].startswith(f"error: {field}") and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_vocab_too_small_for_the_data(prefixes, tmp_path, capsys):
    a, _ = prefixes
    assert main(common(tmp_path) + ["data.source=indexed", f"data.paths={a}", "model.vocab_size=100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("error: model.vocab_size") and "Traceback" not in err, err


def test_indexed_needs_paths(capsys):
    assert main(["data.source=indexed"]) == 2
    assert capsys.readouterr().err.startswith("error: data.paths")


def test_per_process_rows_concatenate_to_the_global_batch(prefixes):
    """Processes 0..P-1 each build only their rows; together they equal the 1-process global batch."""
    from jaxtron.config import load
    from jaxtron.data.corpus import make_corpus
    from jaxtron.data.loader import _LocalBatch, process_rows

    a, b = prefixes
    cfg = load(None, ["data.source=indexed", f"data.paths=0.5 {a} 0.5 {b}", "data.seq_len=32", "train.steps=4"])
    corpus = make_corpus(cfg)
    whole = _LocalBatch(corpus, 8, process_rows(8, 0, 1))(3)
    for procs in (2, 4):
        parts = [_LocalBatch(corpus, 8, process_rows(8, p, procs))(3) for p in range(procs)]
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([x[k] for x in parts]), whole[k])
    with pytest.raises(ValueError, match="not divisible"):
        process_rows(8, 0, 3)
