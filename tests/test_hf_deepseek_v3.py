"""DeepseekV3ForCausalLM <-> jaxtron (Multi-head Latent Attention, DeepSeek MoE routing, MTP weights): fp32 logits
within 1e-4 of transformers in both directions with tiny shapes and O(1) random weights (tests/hf_helpers.py: 3
layers, the first dense, 8 routed experts in 4 groups, top-2 from the best 2 groups, one shared expert, a
non-zero aux-free bias, kv_lora 32, q_lora 24 or none, rope/nope/v widths 16), rope rows in the interleaved and
the plain order, a bit-exact jaxtron -> HF -> jaxtron round trip, greedy generation against transformers'
generate, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtron.config.model_schema import MLAConfig, MoEConfig  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from jaxtron.model.mla import rope_deinterleave_order  # noqa: E402
from jaxtron.model.routing import ExpertBias  # noqa: E402
from hf_helpers import (HEADS, HIDDEN, assert_logits_close, hf_greedy, hf_logits, jax_logits,  # noqa: E402
                        jaxtron_model, random_tokens, randomize_torch)

EXPERTS, TOP_K, GROUPS, TOPK_GROUPS, EXPERT_FFN, FFN, VOCAB, LAYERS = 8, 2, 4, 2, 24, 96, 131, 3
KV_LORA, Q_LORA, NOPE, ROPE, V = 32, 24, 16, 16, 16
# not DeepSeek-V3's 1e-6: the latent norms (q_a_layernorm, kv_a_layernorm) keep 1e-6 whatever rms_norm_eps is,
# in transformers and in jaxtron, and the parity tests would miss it if both were 1e-6
EPS = 1e-5


def _hf_deepseek_v3(*, q_lora=Q_LORA, interleave=True, mtp=0):
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=GROUPS, topk_group=TOPK_GROUPS,
        first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=KV_LORA, q_lora_rank=q_lora,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=interleave,
        num_nextn_predict_layers=mtp, max_position_embeddings=256, rms_norm_eps=EPS, attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    randomize_torch(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a buffer, not a parameter: randomize it too, so a dropped bias shows in the logits
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(EXPERTS, generator=gen))
    return model


def _jaxtron_deepseek_v3(*, q_lora=Q_LORA, aux_free_bias=True, tie=False, mtp=0):
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=TOP_K, expert_intermediate_size=EXPERT_FFN,
                    num_shared_experts=1, first_dense_layers=1, score_func="sigmoid", routed_scaling_factor=2.5,
                    n_group=GROUPS, topk_group=TOPK_GROUPS, aux_free_bias=aux_free_bias)
    mla = MLAConfig(kv_lora_rank=KV_LORA, q_lora_rank=q_lora, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                    v_head_dim=V)
    overrides = dict(mtp=dataclasses.replace(jaxtron_model().cfg.mtp, num_layers=mtp)) if mtp else {}
    return jaxtron_model(moe=moe, mla=mla, num_layers=LAYERS, num_kv_heads=HEADS, vocab_size=VOCAB,
                         intermediate_size=FFN, tie_embeddings=tie, rms_norm_eps=EPS, **overrides)


def _weights(model) -> dict:
    """Every weight the conversion carries: the Params and DeepSeek's aux-free bias."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, ExpertBias)))


PARITY_CASES = {"q_lora-interleaved": (Q_LORA, True), "no-q_lora": (None, True),
                "rope-not-interleaved": (Q_LORA, False)}


@pytest.mark.parametrize("case", PARITY_CASES, ids=list(PARITY_CASES))
def test_deepseek_v3_hf_to_jaxtron_logits(case, tmp_path):
    q_lora, interleave = PARITY_CASES[case]
    hf_model = _hf_deepseek_v3(q_lora=q_lora, interleave=interleave)
    hf_model.save_pretrained(tmp_path)
    cfg, model = hf.load(str(tmp_path), dtype="float32")
    assert cfg.mla == MLAConfig(kv_lora_rank=KV_LORA, q_lora_rank=q_lora or 0, qk_nope_head_dim=NOPE,
                                qk_rope_head_dim=ROPE, v_head_dim=V)
    e = cfg.moe
    assert (e.num_experts, e.num_experts_per_token, e.expert_intermediate_size, e.num_shared_experts) == (
        EXPERTS, TOP_K, EXPERT_FFN, 1)
    assert (e.first_dense_layers, e.n_group, e.topk_group, e.score_func, e.routed_scaling_factor) == (
        1, GROUPS, TOPK_GROUPS, "sigmoid", 2.5)
    assert e.aux_free_bias and cfg.intermediate_size == FFN and cfg.num_kv_heads == HEADS
    assert cfg.mtp.num_layers == 0  # the config says 1 (transformers' default) but save_pretrained wrote none
    attn = hf_model.model.layers[2].self_attn
    hf_rope_key = attn.kv_a_proj_with_mqa.weight.detach().numpy()[KV_LORA:]          # [r, d]
    order = rope_deinterleave_order(ROPE) if interleave else np.arange(ROPE)          # MLA's own statement of it
    np.testing.assert_array_equal(np.asarray(model.layers.attention.wk_rope[...])[1].T, hf_rope_key[order])
    hf_q = (attn.q_b_proj if q_lora else attn.q_proj).weight.detach().numpy().reshape(HEADS, NOPE + ROPE, -1)
    jax_q = np.asarray(model.layers.attention.wq_b[...] if q_lora else model.layers.attention.wq[...])[1]
    np.testing.assert_array_equal(jax_q[:, 3, NOPE:].T, hf_q[3, NOPE:][order])       # head 3's rope rows
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.expert_bias[...])[0],
                                  hf_model.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
    tokens = random_tokens(seed=3, vocab=VOCAB)
    assert_logits_close(jax_logits(model, tokens), hf_logits(hf_model, tokens))


@pytest.mark.parametrize("q_lora, aux_free_bias, tie, mtp", [(Q_LORA, True, False, 1), (0, False, True, 0)],
                         ids=["q_lora-bias-mtp", "no-q_lora-no-bias-tied"])
def test_deepseek_v3_jaxtron_to_hf_round_trip(q_lora, aux_free_bias, tie, mtp, tmp_path):
    """jaxtron -> HF files -> transformers (logits) and -> jaxtron (config and every weight bit for bit, the MTP
    module's too: transformers' model ignores the MTP layer, so only the files carry it)."""
    model = _jaxtron_deepseek_v3(q_lora=q_lora, aux_free_bias=aux_free_bias, tie=tie, mtp=mtp)
    hf.save(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and written["model_type"] == "deepseek_v3"
    assert (written["kv_lora_rank"], written["q_lora_rank"], written["rope_interleave"]) == (
        KV_LORA, q_lora or None, True)
    assert (written["first_k_dense_replace"], written["n_routed_experts"], written["num_nextn_predict_layers"]) == (
        1, EXPERTS, mtp)
    files = hf.SafetensorsFiles(str(tmp_path))
    mtp_names = {n for n in files if n.startswith(f"model.layers.{LAYERS}.")}
    if mtp:  # DeepSeek's MTP layer: its own weights, an MoE decoder layer, and copies of the embedding and head
        assert {f"model.layers.{LAYERS}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                       "shared_head.norm.weight", "embed_tokens.weight",
                                                       "shared_head.head.weight", "mlp.gate.e_score_correction_bias",
                                                       "self_attn.kv_b_proj.weight")} <= mtp_names
        np.testing.assert_array_equal(files[f"model.layers.{LAYERS}.eh_proj.weight"],
                                      np.asarray(model.mtp.eh_proj[...])[0].T)
    else:
        assert not mtp_names
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    hf_model.eval()
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    if not aux_free_bias:  # DeepSeek-V3 always routes with a bias: a model without one exports zeros
        assert not hf_model.model.layers[2].mlp.gate.e_score_correction_bias.any()
    tokens = random_tokens(24, vocab=VOCAB)
    assert_logits_close(hf_logits(hf_model, tokens), jax_logits(model, tokens))
    cfg2, model2 = hf.load(str(tmp_path), dtype="float32")
    # the import always has the aux-free bias (every DeepSeek-V3 checkpoint carries one): zeros here
    assert cfg2 == dataclasses.replace(model.cfg, remat=cfg2.remat,
                                       moe=dataclasses.replace(model.cfg.moe, aux_free_bias=True))
    expected = _weights(model)
    if not aux_free_bias:
        expected["layers"]["mlp"]["expert_bias"] = np.zeros((LAYERS - 1, EXPERTS), np.float32)
    jax.tree.map(np.testing.assert_array_equal, _weights(model2), expected)
    if aux_free_bias:  # a checkpoint whose bias routes cannot load into a model without one
        with pytest.raises(ValueError, match=r"e_score_correction_bias is non-zero but model\.moe\.aux_free_bias is "
                                             r"false \(the model would pick other experts\); set it true$"):
            hf.params_from_hf(dataclasses.replace(cfg2, moe=dataclasses.replace(cfg2.moe, aux_free_bias=False)),
                              hf.SafetensorsFiles(str(tmp_path)))


def test_imported_deepseek_v3_greedy_generation_matches_transformers(tmp_path):
    """Batched, left-padded greedy decoding of an imported DeepSeek-V3 with MLA's latent KV cache (the absorbed
    form) equals transformers' generate (which caches per-head keys and values) token for token."""
    from jaxtron.generate import generate

    hf_model = _hf_deepseek_v3()
    hf_model.save_pretrained(tmp_path)
    _, model = hf.load(str(tmp_path), dtype="float32")
    prompts, new = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]], 8
    expected = [hf_greedy(hf_model, p, new) for p in prompts]
    assert generate(model, prompts, max_new_tokens=new).rows() == expected


def _hf_config(**change) -> dict:
    config = hf.config_to_hf(_jaxtron_deepseek_v3().cfg)
    config.update(change)
    return config


@pytest.mark.parametrize("change, pattern", [
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config \(quant_method='fp8'\) is not supported"),
    ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
    ({"attention_bias": True}, r"attention_bias=true is not supported for DeepseekV3ForCausalLM"),
    ({"n_shared_experts": 0}, r"n_shared_experts=0 is not supported"),
    ({"first_k_dense_replace": LAYERS}, r"first_k_dense_replace=3 leaves no MoE layer of 3"),
    ({"kv_lora_rank": None}, r"required key 'kv_lora_rank' is missing"),
    ({"qk_rope_head_dim": 15}, r"qk_rope_head_dim=15 must be even for RoPE"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_parameters.rope_type='longrope' is "
                                                                        r"not supported"),
    # (DeepSeek-V3's released YaRN rope_scaling imports: tests/test_yarn.py)
])
def test_unsupported_deepseek_v3_config_is_refused_in_one_line(change, pattern):
    with pytest.raises(ValueError, match=r"^cfg\.json: " + pattern) as err:
        hf.config_from_hf(_hf_config(**change), source="cfg.json")
    assert "\n" not in str(err.value)


def test_deepseek_v3_export_refusals_are_one_line():
    cfg = _jaxtron_deepseek_v3().cfg
    mla_off = dataclasses.replace(cfg, mla=MLAConfig())
    cases = [
        (dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, score_func="softmax")), None,
         r"^model\.moe\.score_func: 'softmax' has no DeepseekV3ForCausalLM equivalent"),
        (dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_expert_intermediate_size=48)), None,
         r"^model\.moe\.shared_expert_intermediate_size: 48 has no DeepseekV3ForCausalLM equivalent"),
        (dataclasses.replace(cfg, moe=MoEConfig()), None, r"^model\.moe\.num_experts: DeepseekV3ForCausalLM export "
                                                         r"needs MoE layers"),
        (cfg, "MixtralForCausalLM", r"^architecture: a model with model\.mla saves as DeepseekV3ForCausalLM"),
        (mla_off, None, r"^model\.moe: a DeepSeek-V3-style MoE \(.*\) saves as DeepseekV3ForCausalLM, which needs "
                        r"Multi-head Latent Attention"),
        (mla_off, "DeepseekV3ForCausalLM", r"^model\.mla\.kv_lora_rank: DeepseekV3ForCausalLM needs Multi-head"),
        (dataclasses.replace(mla_off, moe=MoEConfig(), mtp=dataclasses.replace(cfg.mtp, num_layers=1)), None,
         r"^model\.mtp\.num_layers: 1 multi-token prediction modules have a Hugging Face spelling only in "
         r"DeepseekV3ForCausalLM \(with model\.mla\)$"),
    ]
    for c, arch, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as err:
            hf.config_to_hf(c, arch)
        assert "\n" not in str(err.value)


def test_bfloat16_export_keeps_the_routers_in_float32(tmp_path):
    """A bf16 export keeps DeepSeek-V3's router weights and aux-free biases in fp32 (as transformers does: a
    rounded score or bias changes which experts a token picks), so they come back bit for bit."""
    model = _jaxtron_deepseek_v3()
    hf.save(model, str(tmp_path), dtype="bfloat16")
    files = hf.SafetensorsFiles(str(tmp_path))
    routers = {n for n in files if n.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))}
    assert len(routers) == 2 * (LAYERS - 1)
    assert {str(files[n].dtype) for n in routers} == {"float32"}
    assert {str(files[n].dtype) for n in files if n not in routers} == {"bfloat16"}
    _, model2 = hf.load(str(tmp_path), dtype="float32")
    for key in ("router", "expert_bias"):
        np.testing.assert_array_equal(np.asarray(getattr(model2.layers.mlp, key)[...]),
                                      np.asarray(getattr(model.layers.mlp, key)[...]))
