"""``python -m jaxtron.convert``: import-hf -> fine-tune -> export-hf, checked numerically, and its errors.

One tiny random Llama (vocab 256 so the byte-level built-in corpus can train it; d=64, 2 layers, GQA) with
weights at std 0.1, so that logits are O(1) and weights that were not carried over cannot pass. The CLIs run
as subprocesses, as a user runs them; the error cases call the CLI's main() in this process.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtron import config as config_lib  # noqa: E402
from jaxtron.checkpoint import load_params  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from jaxtron.convert.model_tree import abstract_model  # noqa: E402
from helpers import cpu_xla_flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16), dtype=np.int64)


def _env(devices: int = 1) -> dict:
    return {**os.environ, "XLA_FLAGS": cpu_xla_flags(devices), "JAX_PLATFORMS": "cpu"}


def _run(args: list[str], module: str = "jaxtron.convert", devices: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env=_env(devices), cwd=REPO)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.float().numpy()


def _load_hf(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(folder, torch model) of a tiny random LlamaForCausalLM saved with save_pretrained (safetensors)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                   max_position_embeddings=256, tie_word_embeddings=False,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)
    path = str(tmp_path_factory.mktemp("hf"))
    model.save_pretrained(path, safe_serialization=True)
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    return path, model


@pytest.fixture(scope="module")
def imported(hf_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("imp") / "ckpt")
    _ok(_run(["import-hf", "--hf-dir", hf_model[0], "--out", out]))
    return out


def _abstract_params(model_cfg) -> dict:
    _, abstract = abstract_model(model_cfg)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        nnx.to_pure_dict(abstract))


def test_import_hf_params_and_config(hf_model, imported):
    hf_cfg, model = hf.load(hf_model[0])
    expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    cfg = config_lib.load(os.path.join(imported, "config.yaml"))  # loads back, validated
    assert cfg.model == hf_cfg
    assert config_lib.to_yaml(cfg) == config_lib.to_yaml(
        config_lib.Config(model=hf_cfg))  # the defaults, with the HF model

    params, meta = load_params(imported, _abstract_params(cfg.model))
    assert meta["source"] == "hf" and meta["hf_dir"] == os.path.abspath(hf_model[0]) and meta["step"] == 0
    assert config_lib.from_dict(yaml.safe_load(meta["config"])) == cfg
    flat_e, tree_e = jax.tree_util.tree_flatten(expected)
    flat_p, tree_p = jax.tree_util.tree_flatten(params)
    assert tree_e == tree_p
    for e, p in zip(flat_e, flat_p):
        assert p.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(e))


def test_export_hf_sharded_matches_jaxtron_logits(hf_model, imported, tmp_path):
    _, jax_model = hf.load(hf_model[0])
    jax_logits = np.asarray(nnx.jit(lambda m, t: m(t))(jax_model, jnp.asarray(TOKENS, jnp.int32)))

    out = str(tmp_path / "hf_out")
    # one step directory of a checkpoint; 100 KB shards (the model is ~300 KB in fp32)
    _ok(_run(["export-hf", "--checkpoint", os.path.join(imported, "0"), "--out", out,
              "--max-shard-size", "100KB"]))
    shards = sorted(glob.glob(os.path.join(out, "model-*-of-*.safetensors")))
    assert len(shards) >= 3 and not os.path.exists(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == {os.path.basename(s) for s in shards}
    assert all(os.path.getsize(s) <= 100_000 + 4096 for s in shards)  # + the safetensors header

    logits = _hf_logits(_load_hf(out))
    np.testing.assert_allclose(logits, jax_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, _hf_logits(hf_model[1]), atol=1e-4, rtol=0)


def test_finetune_from_imported_weights_then_export(hf_model, imported, tmp_path):
    """train starts from the imported weights: with a negligible learning rate (optim.lr must be > 0, so
    1e-30; the first step is also lr 0 in warmup) the trained checkpoint, exported back to HF, reproduces the
    original HF model's logits. A run from random init would not."""
    run_dir = str(tmp_path / "run")
    _ok(_run(["--config", os.path.join(imported, "config.yaml"), f"checkpoint.load_weights={imported}",
              f"train.output_dir={run_dir}", "train.steps=1", "optim.lr=1e-30", "data.seq_len=16",
              "train.global_batch_size=8", "train.eval_batches=1", "logging.progress=false",
              "logging.tensorboard=false", "data.max_corpus_bytes=2000000", "parallel.fsdp=2"],
             module="jaxtron.train", devices=2))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses and math.isfinite(losses[0])
    assert all(math.isfinite(r["eval_loss"]) for r in records if "eval_loss" in r)

    out = str(tmp_path / "hf_ft")
    # the training checkpoint directory (steps as subdirectories), saved sharded over fsdp=2, read on 1 device
    _ok(_run(["export-hf", "--checkpoint", os.path.join(run_dir, "checkpoints"), "--out", out]))
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    np.testing.assert_allclose(_hf_logits(_load_hf(out)), _hf_logits(hf_model[1]), atol=1e-5, rtol=0)


def _assert_one_error_line(args: list[str], path: str, capsys) -> None:
    """``python -m jaxtron.convert ARGS`` fails with exit status 2 and one ``error:`` line naming ``path``. In
    this process: main() is what the module runs (an exception would fail the test), without a Python start-up
    per case."""
    from jaxtron.convert.__main__ import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert path in errors[0], errors[0]


def test_import_hf_missing_dir(tmp_path, capsys):
    missing = str(tmp_path / "no_such_hf")
    _assert_one_error_line(["import-hf", "--hf-dir", missing, "--out", str(tmp_path / "ck")], missing, capsys)
    assert not os.path.exists(tmp_path / "ck")


def test_export_hf_empty_checkpoint_dir(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_one_error_line(["export-hf", "--checkpoint", str(empty), "--out", str(tmp_path / "o")], str(empty),
                           capsys)


def test_export_hf_corrupt_checkpoint(imported, tmp_path, capsys):
    broken = str(tmp_path / "broken")
    shutil.copytree(imported, broken)
    victim = sorted(glob.glob(os.path.join(broken, "0", "params", "*.bin")))[0]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    _assert_one_error_line(["export-hf", "--checkpoint", broken, "--out", str(tmp_path / "o")], victim, capsys)
