"""``jaxtron.evaluate``: loss/perplexity over non-overlapping windows of a text file or a ``.bin/.idx``
prefix, checked against a direct computation with the model on the same windows; and the CLI.

The model is a tiny random jaxtron Llama (vocab 256, byte-level) with O(1) weights (std 0.1, norm scales
~1), saved as a weights-only jaxtron checkpoint, so the loss is far from the uniform ln(256).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import cpu_xla_flags, tiny_config
from jaxtron import config as config_lib
from jaxtron.checkpoint import Checkpointer
from jaxtron.data.indexed import write_dataset
from jaxtron.data.tokenizer_record import BYTE_RECORD
from jaxtron.evaluate import __main__ as evaluate_cli
from jaxtron.evaluate import evaluate, windows_from_tokens
from jaxtron.convert.loading import load_model
from jaxtron.model.llama import Llama

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "print([fib(i) for i in range(20)])  # the Fibonacci numbers\n") * 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint directory, model) of a random tiny model saved weights-only."""
    cfg = tiny_config()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
        return 1.0 + 0.2 * noise if is_norm else 0.1 * noise

    params = jax.tree.map_with_path(draw, nnx.to_pure_dict(state))
    out = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    c = Checkpointer(out, keep=1, async_save=False)
    try:
        c.save_params(0, params, {"config": config_lib.to_yaml(cfg), "tokenizer": BYTE_RECORD})
    finally:
        c.close()
    _, model, kind = load_model(out)
    assert kind == "jaxtron"
    return out, model


_forward = nnx.jit(lambda model, tokens: model(tokens))


def _direct_loss(model, tokens: np.ndarray, seq_len: int, n_windows: int) -> float:
    """Mean next-token loss over windows [j*seq_len, j*seq_len + seq_len] computed straight from logits."""
    windows = np.stack([tokens[j * seq_len: j * seq_len + seq_len + 1] for j in range(n_windows)])
    logits = np.asarray(_forward(model, jnp.asarray(windows[:, :-1], jnp.int32)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    target = np.take_along_axis(logp, windows[:, 1:, None].astype(np.int64), axis=-1)[..., 0]
    return float(-target.mean())


def test_windows_are_non_overlapping():
    tokens = np.arange(50)
    batches = list(windows_from_tokens(tokens, seq_len=8, batch_size=4))
    assert [b.shape for b in batches] == [(4, 9), (2, 9)]  # 6 windows; the last 1 token is dropped
    starts = [int(w[0]) for b in batches for w in b]
    assert starts == [0, 8, 16, 24, 32, 40]
    assert [b.shape for b in windows_from_tokens(tokens, 8, 4, max_batches=1)] == [(4, 9)]
    # chunks (documents) are concatenated
    chunks = [np.arange(0, 5), np.arange(5, 30), np.arange(30, 50)]
    np.testing.assert_array_equal(np.concatenate(list(windows_from_tokens(iter(chunks), 8, 4))),
                                  np.concatenate(batches))


def test_evaluate_text_matches_direct(ckpt, tmp_path):
    path, model = ckpt
    tokens = np.frombuffer(TEXT.encode(), np.uint8).astype(np.int64)
    seq, bs = 32, 4
    n_windows = (len(tokens) - 1) // seq
    assert n_windows % bs  # the last batch is partial: the padded path is exercised
    result = evaluate(model, windows_from_tokens(tokens, seq, bs))
    expected = _direct_loss(model, tokens, seq, n_windows)
    assert result["tokens"] == n_windows * seq and result["batches"] == -(-n_windows // bs)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert 1.0 < result["loss"] and abs(result["loss"] - math.log(256)) > 0.1  # not a uniform model

    # the CLI, as a user runs it
    text_file = tmp_path / "fib.txt"
    text_file.write_text(TEXT)
    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jaxtron.evaluate", "--checkpoint", path, "--data", str(text_file),
                           "--seq-len", str(seq), "--batch-size", str(bs), "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loss"] == pytest.approx(expected, rel=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]), rel=1e-12)
    assert out["tokens"] == n_windows * seq


def test_evaluate_indexed_prefix(ckpt, tmp_path, capsys):
    path, model = ckpt
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(1, 256, size=int(n)), 0) for n in rng.integers(20, 90, size=8)]
    prefix = str(tmp_path / "data" / "valid")
    os.makedirs(os.path.dirname(prefix))
    write_dataset(prefix, docs, dtype=np.uint16)
    stream = np.concatenate(docs)
    seq, bs, k = 16, 3, 2
    assert evaluate_cli.main(["--checkpoint", path, "--data", prefix, "--seq-len", str(seq), "--batch-size",
                              str(bs), "--max-batches", str(k), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == k * bs * seq and out["batches"] == k
    assert out["loss"] == pytest.approx(_direct_loss(model, stream, seq, k * bs), rel=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]), rel=1e-12)
    # all of it, given with the .bin suffix, in plain-text output
    assert evaluate_cli.main(["--checkpoint", path, "--data", prefix + ".bin", "--seq-len", str(seq)]) == 0
    text = capsys.readouterr().out
    n_windows = (len(stream) - 1) // seq
    loss = float(text.split("loss:")[1].split()[0])
    ppl = float(text.split("perplexity:")[1].split()[0])
    assert loss == pytest.approx(_direct_loss(model, stream, seq, n_windows), rel=1e-5)
    assert ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_evaluate_dict_batches_with_mask(ckpt):
    _, model = ckpt
    tokens = np.frombuffer(TEXT.encode(), np.uint8).astype(np.int64)
    w = np.stack([tokens[i * 16: i * 16 + 17] for i in range(4)])
    mask = np.zeros((4, 16), np.float32)
    mask[:2] = 1.0  # only the first two windows count
    res = evaluate(model, [{"inputs": w[:, :-1], "targets": w[:, 1:], "loss_mask": mask}])
    assert res["tokens"] == 32
    assert res["loss"] == pytest.approx(_direct_loss(model, tokens, 16, 2), rel=1e-5)


def test_evaluate_cli_errors(ckpt, tmp_path, capsys):
    path, _ = ckpt
    short = tmp_path / "short.txt"
    short.write_text("abc")
    only_bin = tmp_path / "half"
    (tmp_path / "half.bin").write_bytes(b"\x00\x01")
    for argv, needle in [
        (["--checkpoint", path, "--data", str(tmp_path / "missing")], "neither a text file"),
        (["--checkpoint", path, "--data", str(short)], "no tokens"),
        (["--checkpoint", path, "--data", str(only_bin)], ".idx is missing"),
        (["--checkpoint", str(tmp_path / "nope"), "--data", str(short)], "does not exist"),
        (["--checkpoint", path, "--data", str(short), "--seq-len", "0"], "--seq-len"),
    ]:
        assert evaluate_cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (argv, err)
