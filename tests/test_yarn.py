"""YaRN RoPE scaling (``model.rope_scaling.type: yarn``) against transformers 5: the inverse frequencies and the
cos/sin factor (``attention_factor``) directly, fp32 logits within 1e-4 of ``DeepseekV3ForCausalLM`` (which also
multiplies MLA's softmax scale by yarn_get_mscale(factor, mscale_all_dim)^2) and of ``LlamaForCausalLM`` and
``Qwen2ForCausalLM`` (cos/sin factor only) at positions past original_max_position_embeddings, greedy decoding
with MLA's latent cache equal to transformers' generate, the fused RoPE kernel's path, the HF config round trip,
and the one-line refusals.

Tiny shapes (tests/hf_helpers.py's d=64, 4 heads; DeepSeek-V3 with 2 layers, the first dense, 4 experts), yarn
factor 4 over an original context of 32, sequences of 64."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxtron  # noqa: E402
from jaxtron.config import ModelConfig, RopeScalingConfig  # noqa: E402
from jaxtron.config.model_schema import MLAConfig, MoEConfig  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from jaxtron.model.layers import rope_attention_factor, rope_frequencies  # noqa: E402
from jaxtron.model.llama import Llama  # noqa: E402
from hf_helpers import (HEADS, HIDDEN, assert_logits_close, hf_greedy, hf_logits, jax_logits,  # noqa: E402
                        jaxtron_model, random_tokens, randomize_torch)

from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding  # noqa: E402

VOCAB, FFN, EXPERT_FFN, EXPERTS, LAYERS = 131, 96, 24, 4, 2
KV_LORA, Q_LORA, NOPE, ROPE, V = 32, 24, 16, 16, 16
FACTOR, ORIGINAL, SEQ = 4.0, 32, 64

# (mscale, mscale_all_dim): DeepSeek-V3's released pair (cos/sin factor 1, softmax scale times mscale^2) and an
# unequal pair, whose cos/sin factor is not 1 (both corrections at once)
MSCALES = {"deepseek": (1.0, 1.0), "unequal": (1.0, 0.5)}


def _yarn_params(mscale, mscale_all_dim, factor=FACTOR, original=ORIGINAL) -> dict:
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
              "original_max_position_embeddings": original, "beta_fast": 32.0, "beta_slow": 1.0}
    params.update({k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)) if v is not None})
    return params


def _hf_deepseek_v3(mscale, mscale_all_dim):
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, kv_lora_rank=KV_LORA, q_lora_rank=Q_LORA, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
        max_position_embeddings=int(FACTOR * ORIGINAL), rope_parameters=_yarn_params(mscale, mscale_all_dim),
        attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    randomize_torch(model)
    return model


def _with_cfg(model: Llama, cfg: ModelConfig) -> Llama:
    """``model``'s weights under another config of the same shapes (the config is static: in the graphdef)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def _rope_cfg(mscale, mscale_all_dim, factor=FACTOR, original=ORIGINAL, rope=ROPE) -> ModelConfig:
    rs = RopeScalingConfig(type="yarn", factor=factor, original_max_position_embeddings=original,
                           mscale=mscale or 0.0, mscale_all_dim=mscale_all_dim or 0.0)
    return ModelConfig(hidden_size=HIDDEN, num_heads=HEADS, rope_theta=10000.0, rope_scaling=rs,
                       mla=MLAConfig(kv_lora_rank=KV_LORA, qk_rope_head_dim=rope))


@pytest.mark.parametrize("factor, original, mscale, mscale_all_dim, rope", [
    (FACTOR, ORIGINAL, 1.0, 1.0, ROPE), (FACTOR, ORIGINAL, 1.0, 0.5, ROPE),
    (FACTOR, ORIGINAL, None, 1.0, ROPE),   # mscale_all_dim alone: transformers ignores it for cos/sin
    (8.0, 64, 0.8, None, ROPE),            # mscale alone: ignored too (0.1 ln factor + 1)
    (40.0, 4096, 1.0, 1.0, 64),            # the released DeepSeek-V3
], ids=["deepseek-tiny", "unequal", "mscale_all_dim-only", "mscale-only", "deepseek-v3-671b"])
def test_frequencies_and_cos_sin_factor_match_transformers(factor, original, mscale, mscale_all_dim, rope):
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, qk_rope_head_dim=rope,
                                           max_position_embeddings=int(factor * original),
                                           rope_parameters=_yarn_params(mscale, mscale_all_dim, factor, original))
    expected = DeepseekV3RotaryEmbedding(config)
    cfg = _rope_cfg(mscale, mscale_all_dim, factor, original, rope)
    # 1e-6: XLA's and torch's fp32 pow differ in the last bit for theta^(2i/d) at some i
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), expected.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(expected.attention_scaling, rel=1e-12)
    assert rope_frequencies(cfg).shape == (rope // 2,)


@pytest.mark.parametrize("case", MSCALES, ids=list(MSCALES))
def test_deepseek_v3_yarn_logits_match_transformers(case, tmp_path):
    mscale, mscale_all_dim = MSCALES[case]
    hf_model = _hf_deepseek_v3(mscale, mscale_all_dim)
    hf_model.save_pretrained(tmp_path)
    cfg, model = hf.load(str(tmp_path), dtype="float32")
    assert cfg.rope_scaling == RopeScalingConfig(type="yarn", factor=FACTOR, original_max_position_embeddings=ORIGINAL,
                                                 beta_fast=32.0, beta_slow=1.0, mscale=mscale,
                                                 mscale_all_dim=mscale_all_dim)
    tokens = random_tokens(SEQ, seed=3, vocab=VOCAB)
    assert_logits_close(jax_logits(model, tokens), hf_logits(hf_model, tokens))
    # the same weights without yarn are far off: the comparison sees the scaling
    plain = _with_cfg(model, dataclasses.replace(model.cfg, rope_scaling=RopeScalingConfig()))
    assert not np.allclose(jax_logits(plain, tokens), hf_logits(hf_model, tokens), rtol=1e-2, atol=1e-2)


def test_deepseek_v3_yarn_export_matches_transformers(tmp_path):
    """jaxtron (unequal mscales) -> HF files: transformers' logits equal jaxtron's, and the config comes back."""
    mla = MLAConfig(kv_lora_rank=KV_LORA, q_lora_rank=Q_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                    v_head_dim=V)
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=2, expert_intermediate_size=EXPERT_FFN,
                    num_shared_experts=1, first_dense_layers=1, score_func="sigmoid", routed_scaling_factor=2.5,
                    n_group=2, topk_group=1, aux_free_bias=True)
    rs = RopeScalingConfig(type="yarn", factor=FACTOR, original_max_position_embeddings=ORIGINAL, mscale=1.0,
                           mscale_all_dim=0.5)
    model = jaxtron_model(moe=moe, mla=mla, num_layers=LAYERS, num_kv_heads=HEADS, vocab_size=VOCAB,
                          intermediate_size=FFN, rms_norm_eps=1e-5, rope_scaling=rs)
    hf.save(model, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert hf_model.model.rotary_emb.attention_scaling != 1.0
    tokens = random_tokens(SEQ, seed=5, vocab=VOCAB)
    assert_logits_close(hf_logits(hf_model, tokens), jax_logits(model, tokens))
    assert hf.load(str(tmp_path), dtype="float32")[0].rope_scaling == rs


def test_deepseek_v3_yarn_greedy_generation_matches_transformers(tmp_path):
    """Greedy decoding through MLA's latent cache (absorbed form, the yarn softmax scale there too) past the
    original context equals transformers' generate token for token."""
    from jaxtron.generate import generate

    hf_model = _hf_deepseek_v3(1.0, 1.0)
    hf_model.save_pretrained(tmp_path)
    _, model = hf.load(str(tmp_path), dtype="float32")
    rng = np.random.default_rng(7)
    prompts, new = [rng.integers(1, VOCAB, 30).tolist(), rng.integers(1, VOCAB, 9).tolist()], 8
    expected = [hf_greedy(hf_model, p, new) for p in prompts]
    assert generate(model, prompts, max_new_tokens=new).rows() == expected


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
def test_llama_and_qwen2_yarn_logits_match_transformers(arch, tmp_path):
    """Llama/Qwen-style yarn configs (no mscale keys; Qwen2.5's spelling): transformers multiplies cos/sin by
    0.1 ln factor + 1 and leaves the softmax scale alone; for Llama also the fused RoPE kernel's path
    (rope_impl=pallas, its output scaled)."""
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=int(FACTOR * ORIGINAL),
        rms_norm_eps=1e-5, rope_parameters=_yarn_params(None, None), attn_implementation="eager")
    hf_model = getattr(transformers, f"{arch}ForCausalLM")(config).float().eval()
    randomize_torch(hf_model)
    hf_model.save_pretrained(tmp_path)
    cfg, model = hf.load(str(tmp_path), dtype="float32")
    assert (cfg.rope_scaling.type, cfg.rope_scaling.mscale, cfg.rope_scaling.mscale_all_dim) == ("yarn", 0.0, 0.0)
    assert rope_attention_factor(cfg) == pytest.approx(0.1 * np.log(FACTOR) + 1)
    tokens = random_tokens(SEQ, seed=4, vocab=VOCAB)
    expected = hf_logits(hf_model, tokens)
    assert_logits_close(jax_logits(model, tokens), expected)
    if arch != "Llama":
        return
    fused = _with_cfg(model, dataclasses.replace(model.cfg, rope_impl="pallas"))  # interpreted on CPU
    assert_logits_close(jax_logits(fused, tokens), expected)


def test_yarn_config_round_trips_through_hf():
    for rs in (RopeScalingConfig(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                                 mscale_all_dim=1.0),
               RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=16.0,
                                 beta_slow=2.0, mscale=0.0, mscale_all_dim=0.7),
               RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32768, mscale=0.0)):
        cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                          num_kv_heads=2, rope_scaling=rs)
        written = hf.config_to_hf(cfg)
        assert written["rope_scaling"]["rope_type"] == "yarn"
        assert written["max_position_embeddings"] == int(rs.factor * rs.original_max_position_embeddings)
        assert hf.config_from_hf(written).rope_scaling == rs
        legacy = {k: v for k, v in written.items() if k != "rope_parameters"}  # transformers 4 / DeepSeek's spelling
        legacy["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in written["rope_scaling"].items()}
        assert hf.config_from_hf(legacy).rope_scaling == rs


def test_released_deepseek_v3_rope_scaling_imports():
    """The released checkpoint's spelling (transformers 4 ``rope_scaling`` with ``type``, ints for floats)."""
    released = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = hf.config_to_hf(ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS))
    config.update(rope_scaling=released, rope_parameters=None, max_position_embeddings=163840)
    assert hf.config_from_hf(config).rope_scaling == RopeScalingConfig(
        type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
        mscale_all_dim=1.0)


@pytest.mark.parametrize("change, pattern", [
    ({"attention_factor": 1.2}, r"rope_parameters\.attention_factor=1\.2 is not supported"),
    ({"truncate": False}, r"rope_parameters\.truncate=false is not supported"),
    ({"factor": None}, r"rope_parameters\.factor is missing \(required by rope_type 'yarn'\)$"),
])
def test_unsupported_hf_yarn_is_refused_in_one_line(change, pattern):
    config = hf.config_to_hf(ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                                         rope_scaling=RopeScalingConfig(type="yarn", factor=4.0)))
    config.pop("rope_scaling")
    config["rope_parameters"].update(change)
    with pytest.raises(ValueError, match=r"^cfg\.json: " + pattern) as err:
        hf.config_from_hf(config, source="cfg.json")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, pattern", [
    ("model.rope_scaling.factor=0.5", r"^model\.rope_scaling\.factor: must be >= 1 for yarn, got 0\.5$"),
    ("model.rope_scaling.beta_fast=1", r"^model\.rope_scaling\.beta_fast: must be > beta_slow \(1\.0\), got 1"),
    ("model.rope_scaling.beta_slow=0", r"^model\.rope_scaling\.beta_slow: must be > 0, got 0"),
    ("model.rope_scaling.mscale=-1", r"^model\.rope_scaling\.mscale: must be >= 0 \(0: not set\), got -1"),
    ("model.rope_scaling.mscale_all_dim=-0.5", r"^model\.rope_scaling\.mscale_all_dim: must be >= 0"),
    ("model.rope_scaling.original_max_position_embeddings=0",
     r"^model\.rope_scaling\.original_max_position_embeddings: must be > 0, got 0$"),
    ("model.rope_scaling.type=yarm", r"^model\.rope_scaling\.type: 'yarm' is not one of \('none', 'llama3', 'yarn'\)"),
])
def test_bad_yarn_fields_are_one_line_config_errors(override, pattern):
    with pytest.raises(jaxtron.ConfigError, match=pattern) as err:
        jaxtron.load_config("tiny", ["model.rope_scaling.type=yarn", override])
    assert "\n" not in str(err.value)
    assert jaxtron.load_config("tiny", ["model.rope_scaling.type=yarn"]).model.rope_scaling.type == "yarn"
