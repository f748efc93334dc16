"""Dense Qwen3: ``model.qk_norm`` (per-head RMSNorm on q and k before RoPE) and ``Qwen3ForCausalLM``
import/export.

Logit parity with transformers' Qwen3ForCausalLM in fp32 (rtol 1e-4, atol 1e-5, as test_hf_parity.py, whose
helpers and O(1) random weights this reuses), both directions of conversion, greedy generation (the KV-cache
path) token for token against transformers, one-line refusals of what jaxtron cannot reproduce, the planner's
parameter count, and a qk_norm model's loss and gradients on data2 x tensor2 equal to one device's.

The tiny model has GQA (4 heads, 2 kv heads), an odd vocabulary (131) and head_dim 24 != hidden/heads (16),
as real Qwen3s (0.6B: 1024 / 16 heads, head_dim 128), so a wrong head_dim mapping cannot hide.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import synthetic_batch, tiny_config  # noqa: E402
from hf_helpers import assert_logits_close, hf_greedy, hf_logits, jax_logits, randomize_torch  # noqa: E402

from jaxtron.config import ModelConfig  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from jaxtron.generate import generate  # noqa: E402
from jaxtron.model.llama import Llama  # noqa: E402
from jaxtron.plan.model import param_count  # noqa: E402
from jaxtron.train.trainer import Trainer, put_batch  # noqa: E402

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 131, 64, 96, 2, 4, 2, 24
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]]  # different lengths: left padding in the KV cache


def _hf_qwen3(tie: bool, **extra):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=tie,
        rms_norm_eps=1e-6, max_position_embeddings=256, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 1e6},
        attn_implementation="eager", **extra)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    randomize_torch(model)  # q_norm/k_norm scales ~ 1 + N(0, 0.2): a dropped or swapped norm shows
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _tokens(seq: int = 16) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, seq), dtype=np.int64)


@functools.cache
def _imported(tie: bool, path: str):
    """(torch model, jaxtron config and model loaded from its save_pretrained folder in fp32), once per tie."""
    hf_model = _hf_qwen3(tie=tie)
    hf_model.save_pretrained(path)
    cfg, model = hf.load(path, dtype="float32")
    return hf_model, cfg, model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return lambda tie: _imported(tie, str(tmp_path_factory.getbasetemp() / f"qwen3-tie{int(tie)}"))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_to_jaxtron_logits(imported, tie):
    hf_model, cfg, model = imported(tie)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == HEAD_DIM and cfg.rms_norm_eps == 1e-6
    assert cfg.tie_embeddings is hf_model.config.tie_word_embeddings and cfg.rope_theta == 1e6
    k_norm = hf_model.model.layers[1].self_attn.k_norm.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.layers.attention.k_norm.scale[...])[1], k_norm)
    tokens = _tokens()
    assert_logits_close(jax_logits(model, tokens), hf_logits(hf_model, tokens))


def test_greedy_generation_matches_transformers(imported):
    """jaxtron's batched, left-padded KV-cache decoding goes through the same normalized attention. (Untied
    only: tying changes the logits alone, which the parity test covers; each model costs two compiles.)"""
    hf_model, _, model = imported(False)
    expected = [hf_greedy(hf_model, p, 8) for p in PROMPTS]
    assert generate(model, PROMPTS, max_new_tokens=8).rows() == expected


def _random_model(seed: int = 1, **overrides) -> Llama:
    """A jaxtron Qwen3 with O(1) random weights (norm scales ~ 1 + N(0, 0.2)), built abstractly as hf.load."""
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                  head_dim=HEAD_DIM, intermediate_size=FFN, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True,
                  dtype="float32", param_dtype="float32")
    cfg = ModelConfig(**{**fields, **overrides})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        return jnp.asarray(1.0 + 0.2 * noise if "norm" in jax.tree_util.keystr(path) else 0.1 * noise)

    nnx.replace_by_pure_dict(state, jax.tree.map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_jaxtron_to_hf_and_back(tie, tmp_path):
    model = _random_model(tie_embeddings=tie)
    hf.save(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["Qwen3ForCausalLM"] and written["model_type"] == "qwen3"
    assert written["head_dim"] == HEAD_DIM and written["attention_bias"] is False
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    assert type(hf_model).__name__ == "Qwen3ForCausalLM" and hf_model.config.tie_word_embeddings is tie
    tokens = _tokens()
    expected = jax_logits(model, tokens)
    assert_logits_close(hf_logits(hf_model.eval(), tokens), expected)

    cfg2, model2 = hf.load(str(tmp_path), dtype="float32")
    assert cfg2 == model.cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model2, nnx.Param)),
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_qk_norm_is_applied_to_q_and_k_before_rope():
    """RMSNorm makes each head's q and k scale-free: scaling wq and wk up changes nothing with qk_norm, and
    changes the logits without it. (Up, so that eps counts for less, not more; a norm after RoPE would pass
    this too, transformers parity above pins the order.)"""
    tokens = _tokens()
    for qk_norm in (True, False):
        model = _random_model(qk_norm=qk_norm)
        before = jax_logits(model, tokens)
        model.layers.attention.wq[...] = 7.0 * model.layers.attention.wq[...]
        model.layers.attention.wk[...] = 3.0 * model.layers.attention.wk[...]
        after = jax_logits(model, tokens)
        if qk_norm:
            assert_logits_close(after, before)
        else:
            assert np.abs(after - before).max() > 1e-2


def test_qk_norm_false_is_unchanged():
    """Without qk_norm the attention holds exactly the Llama weights, exports as Llama, and counts as before."""
    cfg = ModelConfig()
    assert not cfg.qk_norm
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    assert sorted(state["layers"]["attention"]) == ["wk", "wo", "wq", "wv"]
    written = hf.config_to_hf(cfg)
    assert written["architectures"] == ["LlamaForCausalLM"] and hf.config_from_hf(written) == cfg


@pytest.mark.parametrize("overrides", [dict(qk_norm=True), dict(qk_norm=True, qkv_bias=True), dict()])
def test_planner_counts_the_qk_norm_params(overrides):
    cfg = ModelConfig(head_dim=48, tie_embeddings=True, **overrides)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    actual = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert param_count(cfg) == actual


def test_qwen3_8b_preset_has_qwen3_8b_parameter_count():
    """8,190,735,360: the parameters of the Qwen/Qwen3-8B checkpoint (36 x 2 x 128 of them the q/k norms)."""
    from jaxtron import config as config_lib

    assert param_count(config_lib.load("qwen3_8b").model) == 8_190_735_360


def _qwen3_config(**change) -> dict:
    config = hf.config_to_hf(_random_model().cfg)
    config.update(change)
    return config


@pytest.mark.parametrize("change, pattern", [
    ({"attention_bias": True}, r"attention_bias=true is not supported for Qwen3ForCausalLM"),
    ({"use_sliding_window": True, "sliding_window": 8}, r"use_sliding_window=true is not supported"),
    ({"model_type": "qwen2"}, r"model_type='qwen2' does not match architectures=\['Qwen3ForCausalLM'\]"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, r"architectures=\['Qwen2MoeForCausalLM'\] is not supported"),
])
def test_unsupported_qwen3_config_is_refused_in_one_line(change, pattern):
    with pytest.raises(ValueError, match=r"^cfg\.json: " + pattern) as err:
        hf.config_from_hf(_qwen3_config(**change), source="cfg.json")
    assert "\n" not in str(err.value)


def test_qwen3_config_keys_old_and_new():
    """transformers 5 (rope_parameters) and 4 (top-level rope_theta) spellings read the same; a config.json
    without head_dim gets transformers' Qwen3 default of 128, not hidden/heads."""
    written = _qwen3_config()
    cfg = hf.config_from_hf(written)
    new_style = {k: v for k, v in written.items() if k not in ("rope_scaling", "rope_theta")}
    legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
    assert hf.config_from_hf(new_style) == cfg == hf.config_from_hf(legacy)
    no_head_dim = {k: v for k, v in written.items() if k != "head_dim"}
    assert hf.config_from_hf(no_head_dim).head_dim == 128
    assert transformers.Qwen3Config(**{k: v for k, v in no_head_dim.items()
                                       if k not in ("architectures", "model_type")}).head_dim == 128


@pytest.mark.parametrize("overrides, architecture, pattern", [
    (dict(qk_norm=True), "LlamaForCausalLM", r"^model\.qk_norm: LlamaForCausalLM has no Q/K norms"),
    (dict(qk_norm=True, qkv_bias=True), "Qwen2ForCausalLM", r"^model\.qk_norm: Qwen2ForCausalLM has no Q/K"),
    (dict(qk_norm=False), "Qwen3ForCausalLM", r"^model\.qk_norm: Qwen3ForCausalLM needs Q/K norms"),
    (dict(qk_norm=True, qkv_bias=True), None, r"^model\.qkv_bias: Qwen3ForCausalLM has no Q/K/V-only bias"),
])
def test_export_refuses_what_the_architecture_cannot_hold(overrides, architecture, pattern):
    cfg = dataclasses.replace(_random_model().cfg, **overrides)
    with pytest.raises(ValueError, match=pattern) as err:
        hf.config_to_hf(cfg, architecture)
    assert "\n" not in str(err.value)


def _loss_and_gradients(*overrides: str, devices) -> tuple[float, float, dict]:
    """The train step's own loss, gradient norm and fp32 gradient (leaf by leaf) of one batch at the initial
    parameters (``Trainer.gradients``: the accumulation/sharding path of the step, before the optimizer)."""
    cfg = tiny_config("model.qk_norm=true", *overrides)
    trainer = Trainer(cfg, devices)
    grads, metrics = trainer.gradients(put_batch(synthetic_batch(cfg, 0), trainer.batch_sharding))
    return float(metrics["loss"]), float(metrics["grad_norm"]), jax.tree.map(np.asarray, grads)


def test_qk_norm_layout_equals_one_device():
    """The [head_dim] norm scales are replicated over tensor parallelism while the heads they scale are split,
    so their gradients are sums over the tensor shards: data2 x tensor2 (4 of the 8 CPU devices) must give the
    one-device loss and gradients (relative L2 error per leaf, as tests/test_parallel.py). Gradients only, one
    compile per layout: the optimizer update after them does not depend on qk_norm and test_parallel.py
    checks it."""
    loss1, norm1, grads1 = _loss_and_gradients("parallel.data=1", devices=jax.devices()[:1])
    loss4, norm4, grads4 = _loss_and_gradients("parallel.data=2", "parallel.tensor=2", devices=jax.devices()[:4])
    assert set(grads1["layers"]["attention"]) >= {"q_norm", "k_norm"}
    np.testing.assert_allclose([loss4, norm4], [loss1, norm1], rtol=1e-5)
    for (path, expected), actual in zip(jax.tree_util.tree_leaves_with_path(grads1), jax.tree.leaves(grads4)):
        scale = np.linalg.norm(expected)
        assert scale > 0, f"{jax.tree_util.keystr(path)}: the one-device gradient is zero"
        err = np.linalg.norm(actual - expected) / scale
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative gradient difference {err:.2e}"
