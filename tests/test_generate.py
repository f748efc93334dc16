"""Text generation (``jaxtron.generate``): greedy parity with transformers' ``generate`` for Llama and Qwen2,
KV cache == full recompute, nucleus sampling, EOS handling, and the ``python -m jaxtron.generate`` CLI.

Models are tiny random HF models (d=64, 2 layers, GQA) with O(1) weights (std 0.1, as in
test_hf_parity.py) loaded with ``hf.load`` in fp32, so a wrong weight or position cannot hide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtron.convert import checkpoint_io, hf  # noqa: E402
from jaxtron.data.tokenizers import ByteLevelTokenizer  # noqa: E402
from jaxtron.generate import __main__ as generate_cli  # noqa: E402
from jaxtron.generate import generate, generate_no_cache, nucleus_mask, sample_logits  # noqa: E402
from helpers import cpu_xla_flags  # noqa: E402
from hf_helpers import hf_greedy, randomize_torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]]  # different lengths: left padding is exercised
NEW = 12


def _hf_model(arch: str, vocab: int):
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  max_position_embeddings=256, rope_theta=10000.0 if arch == "llama" else 1e6,
                  attn_implementation="eager")
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    model = model.float().eval()
    model.generation_config.eos_token_id = None  # no early stop in transformers' reference generation
    model.generation_config.pad_token_id = 0
    randomize_torch(model)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    """(arch, torch model, HF folder, jaxtron model loaded with hf.load in fp32)."""
    arch = request.param
    hf_model = _hf_model(arch, vocab=256 if arch == "llama" else 128)
    path = str(tmp_path_factory.mktemp(arch))
    hf_model.save_pretrained(path)
    _, model = hf.load(path, dtype="float32")
    return arch, hf_model, path, model


def test_greedy_matches_transformers(pair):
    _, hf_model, _, model = pair
    expected = [hf_greedy(hf_model, p, NEW) for p in PROMPTS]
    out = generate(model, PROMPTS, max_new_tokens=NEW)  # batched, left-padded, KV cache
    assert out.tokens.shape == (2, NEW) and out.tokens.dtype == np.int32
    assert out.lengths.tolist() == [NEW, NEW]
    assert out.rows() == expected
    assert generate_no_cache(model, PROMPTS, max_new_tokens=NEW).rows() == expected
    # a row alone computes what it computes in the padded batch
    assert generate(model, [PROMPTS[1]], max_new_tokens=NEW).rows() == [expected[1]]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.9), (0.7, 1.0)])
def test_cache_matches_no_cache_sampling(pair, temperature, top_p):
    arch, _, _, model = pair
    kw = dict(max_new_tokens=NEW, temperature=temperature, top_p=top_p, seed=3)
    cached = generate(model, PROMPTS, **kw)
    if arch == "llama":  # (one architecture is enough for this; it saves a compile)
        assert cached.rows() == generate_no_cache(model, PROMPTS, **kw).rows()
    assert cached.rows() == generate(model, PROMPTS, **kw).rows()  # reproducible
    other = generate(model, PROMPTS, **{**kw, "seed": 4})
    assert other.rows() != cached.rows()
    greedy = generate(model, PROMPTS, max_new_tokens=NEW)
    assert cached.rows() != greedy.rows()  # really sampled


def test_tiny_top_p_is_greedy(pair):
    _, _, _, model = pair
    greedy = generate(model, PROMPTS, max_new_tokens=NEW)
    nucleus1 = generate(model, PROMPTS, max_new_tokens=NEW, temperature=1.0, top_p=1e-6, seed=5)
    assert nucleus1.rows() == greedy.rows()


def test_nucleus_mask_and_samples():
    probs = np.array([0.05, 0.5, 0.1, 0.3, 0.04, 0.01], np.float32)
    logits = jnp.log(jnp.asarray(probs))
    cases = {0.4: {1}, 0.75: {1, 3}, 0.85: {1, 3, 2}, 0.93: {1, 3, 2, 0}, 0.97: {1, 3, 2, 0, 4},
             1.0: set(range(6))}
    for top_p, expected in cases.items():
        mask = np.asarray(nucleus_mask(logits, top_p))
        assert set(np.flatnonzero(mask).tolist()) == expected, top_p
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    draw = jax.jit(jax.vmap(lambda k: sample_logits(logits, k, 1.0, 0.85)))
    samples = np.asarray(draw(keys))
    assert set(np.unique(samples).tolist()) == {1, 3, 2}  # only (and all of) the nucleus
    freq = np.bincount(samples, minlength=6)[[1, 3, 2]] / len(samples)
    np.testing.assert_allclose(freq, np.array([0.5, 0.3, 0.1]) / 0.9, atol=0.03)  # renormalized in the nucleus
    np.testing.assert_array_equal(samples, np.asarray(draw(keys)))
    # batched logits: a mask per row
    two = jnp.stack([logits, logits[::-1]])
    np.testing.assert_array_equal(np.asarray(nucleus_mask(two, 0.75)),
                                  np.stack([probs >= 0.3, probs[::-1] >= 0.3]))


def test_eos_stops_row(pair):
    _, _, _, model = pair
    free = generate(model, PROMPTS, max_new_tokens=NEW)
    eos = int(free.tokens[0, 2])  # row 0 emits this at step 2
    out = generate(model, PROMPTS, max_new_tokens=NEW, eos_id=eos, pad_id=1)
    for row in range(2):
        hits = np.flatnonzero(free.tokens[row] == eos)
        n = int(hits[0]) + 1 if len(hits) else NEW
        assert out.lengths[row] == n
        np.testing.assert_array_equal(out.tokens[row, :n], free.tokens[row, :n])
        assert (out.tokens[row, n:] == 1).all()
    assert out.lengths[0] <= 3
    # every row stopped at step 0: the loop ends at once and everything else is padding
    first = int(free.tokens[1, 0])
    out = generate(model, [PROMPTS[1]], max_new_tokens=NEW, eos_id=first)
    assert out.lengths.tolist() == [1] and out.tokens[0, 0] == first and (out.tokens[0, 1:] == first).all()
    with pytest.raises(ValueError, match="top_p"):
        generate(model, PROMPTS, max_new_tokens=2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[10**6]], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1], []], max_new_tokens=2)


# ------------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def jaxtron_ckpt(tmp_path_factory):
    """(weights-only jaxtron checkpoint imported from a vocab-256 random Llama, the HF model)."""
    hf_model = _hf_model("llama", vocab=256)
    src = str(tmp_path_factory.mktemp("hfsrc"))
    hf_model.save_pretrained(src)
    out = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    checkpoint_io.import_hf(src, out)
    return out, hf_model


def test_cli_on_jaxtron_checkpoint(jaxtron_ckpt):
    ckpt, hf_model = jaxtron_ckpt
    prompts = ["def main(", "x"]
    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jaxtron.generate", "--checkpoint", ckpt, "--prompt", prompts[0],
                           "--prompt", prompts[1], "--max-new-tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    tok = ByteLevelTokenizer()
    assert [r["prompt"] for r in lines] == prompts
    for r, p in zip(lines, prompts):
        ids = tok.encode(p)
        expected = hf_greedy(hf_model, ids, 6)  # byte tokenizer, greedy: transformers' own answer
        if 0 in expected:  # EOD (byte 0) stops the row
            expected = expected[:expected.index(0) + 1]
        assert r["tokens"] == expected
        assert r["completion"] == tok.decode(expected)


def test_cli_text_output_and_errors(jaxtron_ckpt, capsys, tmp_path):
    ckpt, _ = jaxtron_ckpt
    assert generate_cli.main(["--checkpoint", ckpt, "--prompt", "ab", "--max-new-tokens", "3",
                              "--temperature", "0.8", "--top-p", "0.9", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ab")
    for argv, needle in [
        (["--checkpoint", str(tmp_path / "nope"), "--prompt", "a"], "does not exist"),
        (["--checkpoint", ckpt, "--prompt", "a", "--top-p", "1.5"], "--top-p"),
        (["--checkpoint", ckpt, "--prompt", ""], "no tokens"),
        (["--checkpoint", ckpt, "--prompt", "a", "--tokenizer", str(tmp_path / "tok.json")], "not found"),
    ]:
        assert generate_cli.main(argv) == 2, argv
        # the checkpoint was imported from a folder without a tokenizer: a warning says byte is used
        err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("warning: ")]
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (argv, err)


def test_tensor_parallel_generation_equals_one_device():
    """The same model, its weights and KV cache split over parallel.tensor=2 (the training attention and its
    sharding constraints), generates the same tokens as on one device, greedy, token for token."""
    from jaxtron import config as config_lib
    from jaxtron.generate import generate
    from jaxtron.preflight import inference_layout
    from jaxtron.train.state import create_model

    cfg = config_lib.load(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                 "model.num_kv_heads=2", "model.intermediate_size=128", "model.dtype=float32",
                                 "parallel.data=1"])
    model = create_model(cfg, devices=jax.devices()[:1])
    prompts = [[5, 17, 3, 99, 42], [7, 8]]
    one = generate(model, prompts, max_new_tokens=12)
    layout = inference_layout(cfg.model, ["parallel.tensor=2"])
    assert layout.tp == 2 and layout.num_devices == 2
    sharded = layout.place(model)
    wq = sharded.layers.attention.wq[...]
    assert len(wq.sharding.device_set) == 2 and wq.addressable_shards[0].data.shape[2] == 2  # heads split
    two = generate(sharded, prompts, max_new_tokens=12, layout=layout)
    np.testing.assert_array_equal(two.tokens, one.tokens)
    np.testing.assert_array_equal(two.lengths, one.lengths)


def test_cli_on_a_tensor_parallel_mesh(jaxtron_ckpt, capsys):
    """python -m jaxtron.generate ... parallel.tensor=2 prints what one device prints."""
    ckpt, _ = jaxtron_ckpt
    argv = ["--checkpoint", ckpt, "--prompt", "def main(", "--prompt", "x", "--max-new-tokens", "6", "--json"]
    assert generate_cli.main(argv) == 0
    one = capsys.readouterr().out
    assert generate_cli.main(argv + ["parallel.tensor=2"]) == 0
    assert capsys.readouterr().out == one
    assert generate_cli.main(argv + ["train.steps=3"]) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("warning: ")]
    assert len(err) == 1 and err[0].startswith("error: train.steps: only parallel.* overrides"), err
