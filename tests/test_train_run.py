"""``python -m jaxtron.train`` end to end on the built-in corpus: a log line per log step, strict-JSON metrics,
TensorBoard, the loss falls."""

import json
import os
import re
import subprocess
import sys

import numpy as np

from helpers import cpu_xla_flags, tiny_config
from jaxtron import config as config_lib
from jaxtron.data import BuiltinCorpus


def _strict_json(line):
    def no_constant(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=no_constant)


def test_cli_trains_and_writes_metrics(tmp_path):
    out = tmp_path / "run"
    # overrides on both sides of --config; logging.progress stays true: stderr is not a terminal, so no bar.
    # Sequences of 64 (the preset's 256 costs 4x the step time) and 20 steps: the loss falls by > 2 nats in them
    cmd = [sys.executable, "-m", "jaxtron.train", "train.steps=20", "logging.log_every=5", "--config", "tiny",
           "train.eval_every=10", "model.num_layers=2", "data.seq_len=64", f"train.output_dir={out}"]
    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(2)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr  # no progress-bar frames in a log file
    lines = re.findall(r"jaxtron: step (\d+)/20 \| loss \d+\.\d+ \| grad norm .* \| (\d+) tokens/s \((\d+) per "
                       r"device\) \| .* TFLOP/s per device \| skipped 0$", proc.stderr, re.M)
    assert [int(step) for step, _, _ in lines] == [5, 10, 15, 20], proc.stderr[-3000:]
    assert all(abs(int(tps) - 2 * int(per_dev)) <= 2 for _, tps, per_dev in lines)  # 2 devices
    records = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    for key in ("grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_device", "tflops_per_device_causal",
                "mfu", "mfu_causal"):
        assert key in train[-1]
    assert train[-1]["tokens_per_s"] > 0 and train[-1]["tflops_per_device"] > train[-1]["tflops_per_device_causal"]
    cfg = config_lib.load("tiny", ["data.seq_len=64"])
    assert train[-1]["consumed_samples"] == 20 * cfg.train.global_batch_size
    assert train[-1]["consumed_tokens"] == 20 * cfg.train.global_batch_size * cfg.data.seq_len
    assert all(r["time"] > 1.6e9 and "T" in r["timestamp"] for r in records)
    assert train[0]["time"] <= train[-1]["time"] and "memory_gib" not in train[-1]  # none on CPU
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0  # byte-level: 5.5 nats at init
    assert os.listdir(out / "tensorboard")
    assert (out / "config.yaml").exists()
    assert "held-out loss" in proc.stdout


def test_builtin_corpus_packing_and_masks():
    cfg = tiny_config("data.reset_at_eod=true", "data.eod_mask_loss=true", "data.seq_len=64",
                      "train.global_batch_size=1024", "train.steps=4", "train.eval_batches=2")
    data = BuiltinCorpus(cfg)
    b = data.train_batch(3, 1024)
    again = data.train_batch(3, 1024)
    for k in b:
        np.testing.assert_array_equal(b[k], again[k])  # batch k is a pure function of (seed, k)
    assert b["inputs"].shape == (1024, 64) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    rows = np.nonzero((b["inputs"][:, 1:-1] == 0).any(axis=1))[0]
    assert len(rows), "expected an end-of-document token in some window"
    r = rows[0]
    t = 1 + int(np.nonzero(b["inputs"][r, 1:-1] == 0)[0][0])
    assert b["segment_ids"][r, t + 1] == b["segment_ids"][r, t] + 1  # a new document starts after EOD
    assert b["positions"][r, t + 1] == 0
    # Megatron's --eod-mask-loss: no loss where the input token is EOD (predicting the next document's first
    # token); predicting the EOD itself keeps its loss
    assert b["loss_mask"][r, t] == 0.0 and b["loss_mask"][r, t - 1] == 1.0
    valid = list(data.valid_batches(2, 1024))
    assert len(valid) == 2 and not np.array_equal(valid[0]["inputs"], valid[1]["inputs"])


def test_packed_documents_do_not_attend_across(tmp_path):
    """With segment ids, a document's logits do not depend on the document packed before it."""
    import jax.numpy as jnp
    from flax import nnx
    from jaxtron.model.llama import Llama

    cfg = tiny_config()
    # jitted: one compile for the init and one per sequence length, not one per operation
    model = nnx.jit(lambda: Llama(cfg.model, rngs=nnx.Rngs(0)))()
    forward = nnx.jit(lambda m, *args: m(*args))
    rng = np.random.default_rng(0)
    doc_a, doc_b, doc_c = (rng.integers(1, 256, size=n) for n in (5, 7, 5))
    seq1 = np.concatenate([doc_a, doc_b])[None]
    seq2 = np.concatenate([doc_c, doc_b])[None]
    seg = np.array([[1] * 5 + [2] * 7])
    pos = np.array([list(range(5)) + list(range(7))])
    out1 = forward(model, jnp.asarray(seq1), jnp.asarray(pos), jnp.asarray(seg))
    out2 = forward(model, jnp.asarray(seq2), jnp.asarray(pos), jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(out1[0, 5:]), np.asarray(out2[0, 5:]), rtol=1e-5, atol=1e-5)
    alone = forward(model, jnp.asarray(doc_b[None]))
    np.testing.assert_allclose(np.asarray(out1[0, 5:]), np.asarray(alone[0]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(out1[0, :5]), np.asarray(out2[0, :5]))


def test_bad_data_path_fails_before_the_model_is_built(tmp_path, capsys):
    """In this process: main() is what ``python -m jaxtron.train`` runs (an exception would fail the test)."""
    from jaxtron.train.__main__ import main

    (tmp_path / "bad.idx").write_bytes(b"x")
    (tmp_path / "bad.bin").write_bytes(b"x")
    assert main(["data.source=indexed", f"data.paths={tmp_path / 'bad'}", f"train.output_dir={tmp_path / 'run'}"]) != 0
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"error: data.paths: {tmp_path / 'bad.idx'}: truncated"), err
    assert "params" not in err and "Traceback" not in err  # no model summary: it was not built
