"""Qwen3MoeForCausalLM <-> jaxtron: fp32 logits within 1e-4 of transformers in both directions (tiny shapes, O(1)
random weights as in tests/test_hf_parity.py: 8 experts, top-2, GQA, odd vocab, Q/K norms), dense layers from
decoder_sparse_step and mlp_only_layers, greedy generation, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtron.config.model_schema import MoEConfig  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from hf_helpers import (HEADS, HIDDEN, assert_logits_close, hf_greedy, hf_logits, jax_logits,  # noqa: E402
                        jaxtron_model, random_tokens, randomize_torch)

EXPERTS, TOP_K, EXPERT_FFN, FFN, VOCAB, HEAD_DIM = 8, 2, 24, 40, 131, 24  # head_dim * heads != hidden


def _hf_qwen3_moe(*, tie=False, norm_topk=True, layers=2, step=1, mlp_only=()):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk, decoder_sparse_step=step,
        mlp_only_layers=list(mlp_only), tie_word_embeddings=tie, rms_norm_eps=1e-5, max_position_embeddings=256,
        rope_theta=1e6, attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    randomize_torch(model)
    return model


# (tie, norm_topk_prob, layers, decoder_sparse_step, mlp_only_layers) -> (first_dense_layers, layer_freq)
PARITY_CASES = {
    "untied-norm": ((False, True, 2, 1, ()), (0, 1)),
    "tied-nonorm-step2": ((True, False, 4, 2, ()), (0, 2)),
    "first-dense": ((False, False, 3, 1, (0,)), (1, 1)),
}


@pytest.mark.parametrize("case", PARITY_CASES, ids=list(PARITY_CASES))
def test_qwen3_moe_hf_to_jaxtron_logits(case, tmp_path):
    (tie, norm, layers, step, mlp_only), layout = PARITY_CASES[case]
    hf_model = _hf_qwen3_moe(tie=tie, norm_topk=norm, layers=layers, step=step, mlp_only=mlp_only)
    hf_model.save_pretrained(tmp_path)
    cfg, model = hf.load(str(tmp_path), dtype="float32")
    e = cfg.moe
    assert (e.num_experts, e.num_experts_per_token, e.expert_intermediate_size, e.norm_topk_prob) == (
        EXPERTS, TOP_K, EXPERT_FFN, norm)
    assert (e.first_dense_layers, e.layer_freq) == layout and cfg.intermediate_size == FFN
    assert cfg.qk_norm and cfg.head_dim == HEAD_DIM and cfg.tie_embeddings is tie and cfg.vocab_size == VOCAB
    if layout == (0, 1):  # expert 5's gate_proj of layer 1 (transformers fuses [gate; up] in memory)
        hf_gate = hf_model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()[5, :EXPERT_FFN]
        np.testing.assert_array_equal(np.asarray(model.layers.mlp.w_gate[...])[1, 5].T, hf_gate)
    assert_logits_close(jax_logits(model, random_tokens()), hf_logits(hf_model, random_tokens()))


ROUND_TRIP_CASES = {
    "every-layer-untied": dict(num_layers=2, first_dense_layers=0, layer_freq=1, tie=False, norm=True),
    "step2-tied": dict(num_layers=4, first_dense_layers=0, layer_freq=2, tie=True, norm=False),
    "first-dense": dict(num_layers=3, first_dense_layers=1, layer_freq=1, tie=False, norm=False),
}


@pytest.mark.parametrize("case", ROUND_TRIP_CASES, ids=list(ROUND_TRIP_CASES))
def test_qwen3_moe_jaxtron_to_hf_round_trip(case, tmp_path):
    c = ROUND_TRIP_CASES[case]
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=TOP_K, expert_intermediate_size=EXPERT_FFN,
                    first_dense_layers=c["first_dense_layers"], layer_freq=c["layer_freq"], norm_topk_prob=c["norm"])
    model = jaxtron_model(moe=moe, qk_norm=True, num_layers=c["num_layers"], tie_embeddings=c["tie"],
                           vocab_size=VOCAB, head_dim=HEAD_DIM, intermediate_size=FFN)
    hf.save(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["Qwen3MoeForCausalLM"] and written["num_experts"] == EXPERTS
    assert written["decoder_sparse_step"] == c["layer_freq"]
    assert written["mlp_only_layers"] == list(range(c["first_dense_layers"]))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    hf_model.eval()
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    tokens = random_tokens(24)
    assert_logits_close(hf_logits(hf_model, tokens), jax_logits(model, tokens))
    cfg2, model2 = hf.load(str(tmp_path), dtype="float32")
    assert cfg2 == dataclasses.replace(model.cfg, remat=cfg2.remat)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model2, nnx.Param)),
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_imported_qwen3_moe_greedy_generation_matches_transformers(tmp_path):
    """Batched, left-padded, KV-cached greedy decoding of an imported Qwen3-MoE (a dense and an MoE layer per
    scanned unit) equals transformers' generate token for token."""
    from jaxtron.generate import generate

    hf_model = _hf_qwen3_moe(norm_topk=False, layers=2, step=2)
    hf_model.save_pretrained(tmp_path)
    _, model = hf.load(str(tmp_path), dtype="float32")
    prompts, new = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]], 10
    expected = [hf_greedy(hf_model, p, new) for p in prompts]
    assert generate(model, prompts, max_new_tokens=new).rows() == expected


def _hf_config(**change) -> dict:
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=TOP_K, expert_intermediate_size=EXPERT_FFN)
    config = hf.config_to_hf(dataclasses.replace(jaxtron_model().cfg, moe=moe, qk_norm=True))
    config.update(change)
    return config


@pytest.mark.parametrize("change, pattern", [
    ({"attention_bias": True}, r"attention_bias=true is not supported for Qwen3MoeForCausalLM"),
    ({"use_sliding_window": True, "sliding_window": 8}, r"use_sliding_window=true is not supported"),
    ({"mlp_only_layers": [1]}, r"decoder_sparse_step=1 with mlp_only_layers=\[1\] \(MoE layers \[0\] of 2\) is "
                               r"not supported"),
    ({"num_hidden_layers": 3, "decoder_sparse_step": 2}, r"decoder_sparse_step=2 with mlp_only_layers=\[\] "),
    ({"mlp_only_layers": [0, 1]}, r"decoder_sparse_step=1 and mlp_only_layers=\[0, 1\] leave no MoE layer"),
    ({"moe_intermediate_size": None}, r"required key 'moe_intermediate_size' is missing"),
])
def test_unsupported_qwen3_moe_config_is_refused_in_one_line(change, pattern):
    with pytest.raises(ValueError, match=r"^cfg\.json: " + pattern) as err:
        hf.config_from_hf(_hf_config(**change), source="cfg.json")
    assert "\n" not in str(err.value)


def test_moe_export_picks_the_architecture_by_qk_norm():
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=TOP_K, expert_intermediate_size=EXPERT_FFN)
    cfg = dataclasses.replace(jaxtron_model().cfg, moe=moe)
    assert hf.config_to_hf(cfg)["architectures"] == ["MixtralForCausalLM"]
    assert hf.config_to_hf(dataclasses.replace(cfg, qk_norm=True))["architectures"] == ["Qwen3MoeForCausalLM"]
    cases = [
        (dict(qk_norm=True), "MixtralForCausalLM", r"^model\.qk_norm: MixtralForCausalLM has no Q/K norms"),
        (dict(), "Qwen3MoeForCausalLM", r"^model\.qk_norm: Qwen3MoeForCausalLM needs Q/K norms"),
        (dict(qk_norm=True, moe=dataclasses.replace(moe, num_shared_experts=1)), None,
         r"^model\.moe\.num_shared_experts: 1 has no Qwen3MoeForCausalLM equivalent"),
        (dict(qk_norm=True), "Qwen3ForCausalLM", r"^architecture: an MoE model saves as one of"),
    ]
    for overrides, arch, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as err:
            hf.config_to_hf(dataclasses.replace(cfg, **overrides), arch)
        assert "\n" not in str(err.value)
