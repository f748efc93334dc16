"""Hugging Face <-> jaxtron conversion: logits parity with transformers, save/load round trips, errors.

Every model is tiny (d=64, 2 layers, vocab 128) and everything runs in fp32 on CPU. Weights are
re-randomized at std 0.1 (norm scales around 1, non-zero biases) so that logits are O(1) and a swapped or
mis-transposed weight cannot hide behind a near-zero init.

Tolerance: tests/hf_helpers.py (rtol=1e-4, atol=1e-5 on logits, with the reason); its helpers are shared with
the other Hugging Face tests.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from hf_helpers import (FFN, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, assert_logits_close, hf_logits,  # noqa: E402
                        jax_logits, jaxtron_model, random_tokens, randomize_torch)
from jaxtron.config import ModelConfig, RopeScalingConfig  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from jaxtron.model.layers import rope_frequencies  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


# --------------------------------------------------------------------------------------------- helpers


def _hf_model(arch: str, *, kv_heads: int, tie: bool, rope_scaling=None, rope_theta: float = 10000.0):
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                  rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=rope_theta,
                  rope_scaling=rope_scaling, attn_implementation="eager")
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    model = model.float().eval()
    randomize_torch(model)
    return model


# ------------------------------------------------------------------------------- HF -> jaxtron parity

PARITY_CASES = {
    # name: (arch, kv_heads, tie, rope_scaling, rope_theta, seq)
    "llama-mha-untied": ("llama", 4, False, None, 10000.0, SEQ),
    "llama-mha-tied": ("llama", 4, True, None, 10000.0, SEQ),
    "llama-gqa2-untied": ("llama", 2, False, None, 10000.0, SEQ),
    "llama-gqa2-tied": ("llama", 2, True, None, 10000.0, SEQ),
    "llama-gqa4-untied": ("llama", 1, False, None, 500000.0, SEQ),
    "llama-gqa4-tied": ("llama", 1, True, None, 10000.0, SEQ),
    "llama31-rope-scaling": ("llama", 2, False, LLAMA3_ROPE, 10000.0, 64),
    "qwen2-gqa2-untied": ("qwen2", 2, False, None, 1e6, SEQ),
    "qwen2-gqa2-tied": ("qwen2", 2, True, None, 1e6, SEQ),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_hf_to_jaxtron_logits(case, tmp_path):
    arch, kv_heads, tie, rope_scaling, theta, seq = PARITY_CASES[case]
    hf_model = _hf_model(arch, kv_heads=kv_heads, tie=tie, rope_scaling=rope_scaling, rope_theta=theta)
    hf_model.save_pretrained(tmp_path)
    tokens = random_tokens(seq)

    cfg, model = hf.load(str(tmp_path), dtype="float32")

    assert cfg.param_dtype == "float32" and cfg.dtype == "float32"
    assert cfg.num_kv_heads == kv_heads and cfg.num_heads == HEADS and cfg.num_layers == LAYERS
    assert cfg.tie_embeddings is tie and (hasattr(model, "lm_head") is not tie)
    assert cfg.qkv_bias is (arch == "qwen2")
    assert cfg.rope_theta == theta
    assert cfg.rope_scaling.type == ("llama3" if rope_scaling else "none")
    if arch == "qwen2":  # the biases were really loaded (HF inits them to zero; we randomized them)
        bq = np.asarray(model.layers.attention.bq[...])
        hf_bq = hf_model.model.layers[1].self_attn.q_proj.bias.detach().numpy()
        np.testing.assert_array_equal(bq[1].reshape(-1), hf_bq)
        assert np.abs(bq).max() > 0.05
    assert_logits_close(jax_logits(model, tokens), hf_logits(hf_model, tokens))


def test_hf_sharded_bfloat16_checkpoint(tmp_path):
    """transformers' own sharded bf16 output (index + shards, bf16 via ml_dtypes) loads exactly."""
    hf_model = _hf_model("llama", kv_heads=2, tie=False).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) >= 2

    _, model = hf.load(str(tmp_path), dtype="float32")
    # The same bf16-rounded weights computed in fp32 like jaxtron. (Not ``hf_model.float()``: ``.to(bf16)``
    # also rounded the RoPE ``inv_freq`` buffer, which would make the reference itself wrong.)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    q = hf_model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.layers.attention.wq[...])[1].reshape(HIDDEN, -1).T, q)
    tokens = random_tokens()
    assert_logits_close(jax_logits(model, tokens), hf_logits(hf_model, tokens))


def test_llama3_rope_case_exercises_every_scaling_branch():
    """The rope-scaling parity case keeps some frequencies, smooths some and divides others by `factor`,
    and its sequence is longer than original_max_position_embeddings, so a wrong scaling shows up."""
    arch, kv_heads, tie, rope, theta, seq = PARITY_CASES["llama31-rope-scaling"]
    base = ModelConfig(hidden_size=HIDDEN, num_heads=HEADS, rope_theta=theta)
    scaled = dataclasses.replace(base, rope_scaling=RopeScalingConfig(
        type="llama3", factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
        high_freq_factor=rope["high_freq_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"]))
    ratio = np.asarray(rope_frequencies(scaled)) / np.asarray(rope_frequencies(base))
    assert np.isclose(ratio, 1.0).any(), ratio
    assert np.isclose(ratio, 1.0 / rope["factor"]).any(), ratio
    assert ((ratio > 1.0 / rope["factor"] + 1e-3) & (ratio < 1.0 - 1e-3)).any(), ratio
    assert seq > rope["original_max_position_embeddings"]


# ------------------------------------------------------------------------------- jaxtron -> HF round trip

ROUND_TRIP_CASES = {
    "llama-untied-llama3-rope": dict(tie_embeddings=False, rope_scaling=RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "qwen2-tied": dict(tie_embeddings=True, qkv_bias=True, rope_theta=1e6),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP_CASES))
def test_jaxtron_to_hf_round_trip(case, tmp_path):
    model = jaxtron_model(**ROUND_TRIP_CASES[case])
    hf.save(model, str(tmp_path))
    assert os.path.exists(tmp_path / "model.safetensors")
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["dtype"] == "float32" and written["torch_dtype"] == "float32"
    assert written["architectures"] == ["Qwen2ForCausalLM" if model.cfg.qkv_bias else "LlamaForCausalLM"]

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    hf_model.eval()
    assert hf_model.dtype == torch.float32
    assert hf_model.config.tie_word_embeddings is model.cfg.tie_embeddings
    tokens = random_tokens(48)  # longer than original_max_position_embeddings=32 for the llama3 case
    expected = jax_logits(model, tokens)
    assert_logits_close(hf_logits(hf_model, tokens), expected)

    # ... and back: config and weights survive HF -> jaxtron exactly.
    cfg2, model2 = hf.load(str(tmp_path), dtype="float32")
    assert cfg2 == dataclasses.replace(model.cfg, remat=cfg2.remat)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model2, nnx.Param)),
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_sharded_save_loads_in_transformers_and_jaxtron(tmp_path):
    model = jaxtron_model()
    hf.save(model, str(tmp_path), max_shard_bytes=60_000)  # the whole model is ~180 kB in fp32
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not os.path.exists(tmp_path / "model.safetensors")
    for shard in shards:
        assert os.path.getsize(tmp_path / shard) <= 60_000 + 10_000  # + the safetensors header
    expected_names = set(hf.params_to_hf(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    assert set(index["weight_map"]) == expected_names
    assert index["metadata"]["total_size"] == sum(
        a.nbytes for s in shards for a in load_file(str(tmp_path / s)).values())

    tokens = random_tokens()
    expected = jax_logits(model, tokens)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    assert_logits_close(hf_logits(hf_model.eval(), tokens), expected)
    _, model2 = hf.load(str(tmp_path), dtype="float32")
    assert_logits_close(jax_logits(model2, tokens), expected)

    # A second, unsharded save into the same folder must not leave the stale index behind.
    hf.save(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_bfloat16_save_and_load(tmp_path):
    """bf16 files: numpy cannot read them through safetensors' numpy API; they go through ml_dtypes."""
    model = jaxtron_model()
    hf.save(model, str(tmp_path), dtype="bfloat16")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert hf_model.dtype == torch.bfloat16
    hf_embed = hf_model.model.embed_tokens.weight.detach().float().numpy()

    cfg, model2 = hf.load(str(tmp_path))  # default: fp32 master weights, ModelConfig's compute dtype
    assert cfg.param_dtype == "float32" and cfg.dtype == ModelConfig().dtype
    original = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rounded = jax.tree.map(lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)), original)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model2, nnx.Param)), rounded)
    np.testing.assert_array_equal(hf_embed, rounded["embed"])


# ------------------------------------------------------------------------------------- config mapping


def test_config_round_trip_and_legacy_keys():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                      num_kv_heads=1, head_dim=32, intermediate_size=FFN, rope_theta=5e5,
                      rope_scaling=RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0,
                                                     original_max_position_embeddings=8192),
                      rms_norm_eps=1e-5, tie_embeddings=True)
    written = hf.config_to_hf(cfg)
    assert hf.config_from_hf(written) == cfg
    assert written["rope_parameters"] == {**written["rope_scaling"], "rope_theta": 5e5}

    # transformers 5 reads what we write to the same RoPE (and head_dim, GQA, tying).
    parsed = transformers.LlamaConfig(**written)
    assert parsed.rope_parameters["rope_type"] == "llama3" and parsed.rope_parameters["rope_theta"] == 5e5
    assert parsed.rope_parameters["original_max_position_embeddings"] == 8192
    assert parsed.head_dim == 32 and parsed.num_key_value_heads == 1 and parsed.tie_word_embeddings

    # Old-style (transformers 4) and new-style (transformers 5) keys read to the same config.
    legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
    new_style = {k: v for k, v in written.items() if k not in ("rope_scaling", "rope_theta")}
    assert hf.config_from_hf(legacy) == cfg == hf.config_from_hf(new_style)
    legacy_type = dict(legacy, rope_scaling={**{k: v for k, v in legacy["rope_scaling"].items()
                                                if k != "rope_type"}, "type": "llama3"})
    assert hf.config_from_hf(legacy_type) == cfg


# ---------------------------------------------------------------------------------------------- errors


def _tiny_hf_dir(tmp_path, arch: str = "llama"):
    _hf_model(arch, kv_heads=2, tie=False).save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor_names_tensor_and_file(tmp_path):
    _tiny_hf_dir(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf.load(str(tmp_path))


def test_wrong_shape_and_unexpected_tensor(tmp_path):
    _tiny_hf_dir(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((HIDDEN, HIDDEN), np.float32)
    save_file(bad, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj"
                                         r"\.weight has shape \(64, 64\); expected \(32, 64\)"):
        hf.load(str(tmp_path))
    extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(HIDDEN, np.float32)})
    save_file(extra, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.o_proj\.bias"):
        hf.load(str(tmp_path))


def test_unsupported_rope_type_names_key_and_file(tmp_path):
    _tiny_hf_dir(tmp_path)
    config_path = tmp_path / "config.json"
    with open(config_path) as f:
        config = json.load(f)
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0,
                                 "original_max_position_embeddings": 32}
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"config\.json: rope_parameters\.rope_type='longrope' is not supported"):
        hf.load(str(tmp_path))
    # The transformers-4 spelling is named as such.
    legacy = dict(config, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"my/config\.json: rope_scaling\.rope_type='dynamic'"):
        hf.config_from_hf(legacy, source="my/config.json")


@pytest.mark.parametrize("change, pattern", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, r"architectures=.*MistralForCausalLM"),
    ({"attention_bias": True}, r"attention_bias"),
    ({"mlp_bias": True}, r"mlp_bias"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     r"rope_parameters\.low_freq_factor is missing"),
    ({"num_attention_heads": None}, r"'num_attention_heads' is missing"),
])
def test_unsupported_llama_config(change, pattern):
    config = hf.config_to_hf(ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS))
    config.pop("rope_scaling")
    config.update(change)
    with pytest.raises(ValueError, match=r"^cfg\.json: .*" + pattern):
        hf.config_from_hf(config, source="cfg.json")


def test_unsupported_qwen2_sliding_window():
    config = hf.config_to_hf(ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                                         qkv_bias=True))
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert hf.config_from_hf(config).qkv_bias
    config.update(use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match=r"config\.json: use_sliding_window"):
        hf.config_from_hf(config)
