"""MixtralForCausalLM <-> jaxtron: fp32 logits within 1e-4 of transformers in both directions, with the
tiny shapes and O(1) random weights of tests/test_hf_parity.py (8 experts, top-2, GQA, odd vocab)."""

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
from hf_helpers import (HEADS, HIDDEN, LAYERS, assert_logits_close, hf_greedy, hf_logits, jax_logits,  # noqa: E402
                        jaxtron_model, random_tokens, randomize_torch)

EXPERTS, TOP_K, EXPERT_FFN, VOCAB = 8, 2, 48, 131


def _hf_mixtral(tie: bool):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        tie_word_embeddings=tie, rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=1e6,
        sliding_window=None, attn_implementation="eager")
    model = transformers.MixtralForCausalLM(config).float().eval()
    randomize_torch(model)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_mixtral_hf_to_jaxtron_logits(tie, tmp_path):
    hf_model = _hf_mixtral(tie)
    hf_model.save_pretrained(tmp_path)
    cfg, model = hf.load(str(tmp_path), dtype="float32")
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_token, cfg.moe.expert_intermediate_size) == (
        EXPERTS, TOP_K, EXPERT_FFN)
    assert cfg.tie_embeddings is tie and cfg.vocab_size == VOCAB
    hf_w1 = hf_model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()[5, :EXPERT_FFN]  # expert 5's w1
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.w_gate[...])[1, 5].T, hf_w1)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16), dtype=np.int64)
    assert_logits_close(jax_logits(model, tokens), hf_logits(hf_model, tokens))


def test_mixtral_jaxtron_to_hf_round_trip(tmp_path):
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=TOP_K, expert_intermediate_size=EXPERT_FFN)
    model = jaxtron_model(moe=moe)
    hf.save(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["MixtralForCausalLM"] and written["num_local_experts"] == EXPERTS
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    hf_model.eval()
    tokens = random_tokens(24)
    assert_logits_close(hf_logits(hf_model, tokens), jax_logits(model, tokens))
    cfg2, model2 = hf.load(str(tmp_path), dtype="float32")
    # model.intermediate_size (the dense width) has no Mixtral key: every layer is MoE, it is never used, and
    # import sets it to the experts' width
    assert cfg2.intermediate_size == EXPERT_FFN
    assert cfg2 == dataclasses.replace(model.cfg, remat=cfg2.remat, intermediate_size=EXPERT_FFN)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model2, nnx.Param)),
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_moe_configs_mixtral_cannot_hold_are_refused_in_one_line(tmp_path):
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_token=TOP_K, expert_intermediate_size=EXPERT_FFN,
                    num_shared_experts=1)
    with pytest.raises(ValueError, match=r"^model.moe.num_shared_experts: 1 has no MixtralForCausalLM"):
        hf.save(jaxtron_model(moe=moe), str(tmp_path))


def test_imported_mixtral_greedy_generation_matches_transformers(tmp_path):
    """Batched, left-padded, KV-cached greedy decoding of an imported Mixtral equals transformers' generate token
    for token (padding tokens are routed too; dropless routing is per token, so they change nothing)."""
    from jaxtron.generate import generate

    hf_model = _hf_mixtral(False)
    hf_model.save_pretrained(tmp_path)
    _, model = hf.load(str(tmp_path), dtype="float32")
    prompts, new = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]], 10
    expected = [hf_greedy(hf_model, p, new) for p in prompts]
    assert generate(model, prompts, max_new_tokens=new).rows() == expected
