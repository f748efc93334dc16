"""Layer-by-layer parity with transformers' own modules, so that a wrong RoPE scaling, Q/K norm, GQA grouping,
mask or routing fails a test named after that layer instead of "logits differ".

Each case builds a one-layer transformers model (Llama 3.1 with its RoPE scaling and GQA, Qwen3 with Q/K norms
and head_dim != hidden/heads, Mixtral, Qwen3-MoE) with the O(1) random weights of tests/hf_helpers.py, saves it
and loads it with ``jaxtron.convert.hf.load`` (the production weight mapping). The transformers side is the
model's own submodules (``LlamaRMSNorm``, ``LlamaRotaryEmbedding``, ``LlamaAttention``, ``Qwen3Attention``,
``LlamaMLP``, ``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``);
the jaxtron side is the decoder block of layer 0 taken out of the scanned stack (its modules ``attn_norm``,
``attention``, ``mlp``, as ``Llama.run_stack`` merges them) and ``Llama.rope``. Both get the same fp32 input.

Positions and mask are the ones jaxtron trains with: row 0 is one document, row 1 packs two (segment ids 1, 2,
positions restarting at the second document); transformers gets those positions for its RoPE and the equivalent
additive mask (causal within a segment). The sequence (48) is longer than the RoPE scaling's
original_max_position_embeddings (32), and the scaling keeps, smooths and divides some frequencies each.

Tolerance: rtol=1e-5 in fp32. atol=2e-6 for outputs that are sums of O(1) terms (projections, attention,
MLP, router logits: an element that cancels to ~0 keeps the absolute error of the terms, a few fp32 ulps of
O(1), and a relative bound is meaningless for it; measured here, the largest absolute error beyond rtol is
7e-7, in the Qwen3 decoder layer, and the atol leaves room for another BLAS's summation order); the element-wise
RMSNorm and the RoPE frequencies get atol=0, the cos/sin tables 1e-6 (cos of an angle up to ~50 rad: an ulp
of the angle, measured 6e-8).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import HEADS, HIDDEN, randomize_torch  # noqa: E402
from jaxtron.convert import hf  # noqa: E402
from jaxtron.model import routing  # noqa: E402
from jaxtron.model.layers import rope_frequencies  # noqa: E402

RTOL, ATOL = 1e-5, 2e-6
BATCH, SEQ, SPLIT = 2, 48, 20  # row 1 packs two documents: [0, SPLIT) and [SPLIT, SEQ)
VOCAB, FFN, KV_HEADS, EXPERTS, TOP_K, EXPERT_FFN = 128, 96, 2, 8, 2, 40
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 10000.0}
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
              num_key_value_heads=KV_HEADS, tie_word_embeddings=True, max_position_embeddings=256,
              attn_implementation="eager")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        intermediate_size=FFN, rms_norm_eps=1e-5, rope_parameters=LLAMA31_ROPE, **COMMON))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        intermediate_size=FFN, head_dim=24, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **COMMON))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, rms_norm_eps=1e-5,
        rope_theta=1e6, sliding_window=None, **COMMON))


def _qwen3_moe(norm_topk: bool):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN, head_dim=24, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk, rms_norm_eps=1e-6, rope_theta=1e6, **COMMON))


MODELS = {"llama31": _llama, "qwen3": _qwen3, "mixtral": _mixtral,
          "qwen3_moe": lambda: _qwen3_moe(True), "qwen3_moe_unnormalized": lambda: _qwen3_moe(False)}


@dataclasses.dataclass
class Pair:
    hf: object       # transformers' decoder layer 0 (its submodules are the references)
    hf_model: object
    block: object    # jaxtron's decoder block of layer 0, weights loaded through jaxtron.convert.hf
    model: object    # the whole jaxtron model (for Llama.rope)


_PAIRS: dict[str, Pair] = {}


def _pair(name: str, tmp_path_factory) -> Pair:
    """The one-layer model ``name`` in both libraries (built once per test session)."""
    if name not in _PAIRS:
        hf_model = MODELS[name]().float().eval()
        randomize_torch(hf_model)
        path = tmp_path_factory.mktemp(name)
        hf_model.save_pretrained(path)
        _, model = hf.load(str(path), dtype="float32")
        graphdef, stacked = nnx.split(model.layers)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked))
        _PAIRS[name] = Pair(hf_model.model.layers[0], hf_model, block, model)
    return _PAIRS[name]


@pytest.fixture(params=list(MODELS))
def pair(request, tmp_path_factory) -> Pair:
    return _pair(request.param, tmp_path_factory)


# ------------------------------------------------------------------------------------------------- inputs


def _hidden(width: int = HIDDEN, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((BATCH, SEQ, width)).astype(np.float32)


def _packed() -> tuple[np.ndarray, np.ndarray]:
    """(positions, segment_ids) [BATCH, SEQ] as the loader packs documents (data.reset_at_eod)."""
    segment_ids = np.ones((BATCH, SEQ), np.int32)
    segment_ids[1, SPLIT:] = 2
    positions = np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))
    positions[1, SPLIT:] -= SPLIT
    return positions, segment_ids


def _hf_mask(segment_ids: np.ndarray) -> torch.Tensor:
    """transformers' eager attention mask for jaxtron's: additive [B, 1, S, S], 0 where a query (row) may see a
    key (column): not after it and in the same document."""
    seg = torch.from_numpy(segment_ids)
    allowed = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))[None] & (seg[:, :, None] == seg[:, None, :])
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]


def _hf_inputs(p: Pair, x: np.ndarray):
    """(hidden states, (cos, sin), mask) for a transformers layer, from the model's own rotary embedding."""
    positions, segment_ids = _packed()
    hx = torch.from_numpy(x)
    with torch.no_grad():
        rope = p.hf_model.model.rotary_emb(hx, torch.from_numpy(positions).long())
    return hx, rope, _hf_mask(segment_ids)


def _jax_inputs(p: Pair, x: np.ndarray):
    """(x, Rope, segment_ids) for a jaxtron block, the Rope from ``Llama.rope`` (frequencies and tables)."""
    positions, segment_ids = _packed()
    return jnp.asarray(x), p.model.rope(jnp.asarray(positions)), jnp.asarray(segment_ids)


def _close(actual, expected, what: str, atol: float = ATOL) -> None:
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != transformers' {expected.shape}"
    assert np.abs(expected).max() > 0.1, f"{what}: the reference is ~0, the comparison would prove nothing"
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=atol, err_msg=what)


# ------------------------------------------------------------------------------------------------ the layers


def test_rms_norm(pair):
    """LlamaRMSNorm / Qwen3RMSNorm / ... (input_layernorm and post_attention_layernorm) vs jaxtron's RMSNorm."""
    x = _hidden()
    for hf_norm, norm, what in [(pair.hf.input_layernorm, pair.block.attn_norm, "input_layernorm"),
                                (pair.hf.post_attention_layernorm, pair.block.mlp_norm, "post_attention_layernorm")]:
        assert type(hf_norm).__name__.endswith("RMSNorm") and hf_norm.variance_epsilon == norm.eps
        with torch.no_grad():
            _close(norm(jnp.asarray(x)), hf_norm(torch.from_numpy(x)), what, atol=0.0)


@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_rotary_embedding(name, tmp_path_factory):
    """The model's rotary embedding (LlamaRotaryEmbedding with rope_type llama3 for Llama 3.1): the inverse
    frequencies, and the cos/sin tables at jaxtron's packed positions (transformers repeats the [head_dim/2]
    table twice along head_dim: the rotate-half layout both use)."""
    p = _pair(name, tmp_path_factory)
    rotary = p.hf_model.model.rotary_emb
    assert isinstance(rotary, (transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
                               transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding))
    assert rotary.rope_type == ("llama3" if name == "llama31" else "default") and rotary.attention_scaling == 1.0
    _close(rope_frequencies(p.model.cfg), rotary.inv_freq, "RoPE inverse frequencies", atol=0.0)
    x = _hidden()
    _, (cos, sin), _ = _hf_inputs(p, x)
    rope = _jax_inputs(p, x)[1]
    half = rope.cos.shape[-1]
    for table, hf_table, what in [(rope.cos, cos, "cos"), (rope.sin, sin, "sin")]:
        _close(table, hf_table[..., :half], f"RoPE {what}", atol=1e-6)
        _close(table, hf_table[..., half:], f"RoPE {what} (second half)", atol=1e-6)


def test_llama31_rope_case_scales_every_band(tmp_path_factory):
    """The Llama 3.1 case keeps some frequencies, smooths some and divides others by ``factor``, and its
    positions pass original_max_position_embeddings, so each branch of the scaling is compared above."""
    cfg = _pair("llama31", tmp_path_factory).model.cfg
    assert cfg.rope_scaling.type == "llama3"
    ratio = np.asarray(rope_frequencies(cfg)) / np.asarray(
        rope_frequencies(dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, type="none"))))
    factor = LLAMA31_ROPE["factor"]
    assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 1.0 / factor).any(), ratio
    assert ((ratio > 1.0 / factor + 1e-3) & (ratio < 1.0 - 1e-3)).any(), ratio
    assert _packed()[0].max() >= LLAMA31_ROPE["original_max_position_embeddings"]


@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_attention(name, tmp_path_factory):
    """LlamaAttention (GQA: 4 query heads on 2 kv heads, Llama 3.1 RoPE) and Qwen3Attention (per-head Q/K
    RMSNorm before RoPE, head_dim 24 != 64/4), eager, with jaxtron's packed-document positions and mask."""
    p = _pair(name, tmp_path_factory)
    attn_cls = {"llama31": transformers.models.llama.modeling_llama.LlamaAttention,
                "qwen3": transformers.models.qwen3.modeling_qwen3.Qwen3Attention}[name]
    assert type(p.hf.self_attn) is attn_cls
    assert p.block.attention.cfg.qk_norm is (name == "qwen3")
    assert p.hf.self_attn.num_key_value_groups == HEADS // KV_HEADS
    x = _hidden()
    hx, rope, mask = _hf_inputs(p, x)
    with torch.no_grad():
        expected, _ = p.hf.self_attn(hx, position_embeddings=rope, attention_mask=mask)
    _close(p.block.attention(*_jax_inputs(p, x)), expected, f"{attn_cls.__name__} output")


def test_swiglu_mlp(tmp_path_factory):
    """LlamaMLP (down(silu(gate x) * up x)) vs jaxtron's SwiGLU."""
    p = _pair("llama31", tmp_path_factory)
    assert type(p.hf.mlp) is transformers.models.llama.modeling_llama.LlamaMLP
    x = _hidden()
    with torch.no_grad():
        expected = p.hf.mlp(torch.from_numpy(x))
    _close(p.block.mlp(jnp.asarray(x)), expected, "LlamaMLP output")


@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_decoder_layer(name, tmp_path_factory):
    """One whole pre-norm decoder layer (LlamaDecoderLayer, Qwen3DecoderLayer) vs jaxtron's DecoderBlock."""
    p = _pair(name, tmp_path_factory)
    x = _hidden()
    hx, rope, mask = _hf_inputs(p, x)
    with torch.no_grad():
        expected = p.hf(hx, attention_mask=mask, position_embeddings=rope)
    _close(p.block(*_jax_inputs(p, x)), expected, f"{type(p.hf).__name__} output")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalized"])
def test_sparse_moe_block(name, tmp_path_factory):
    """MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock (with and without norm_topk_prob) vs jaxtron's MoE:
    router logits, the chosen experts, their combine weights and the block's output. jaxtron routes as
    transformers does here: softmax scores, top-k, dropless dispatch (no token dropped), no shared expert, no
    bias; the checks below say so, so the comparison cannot pass by a routing difference that happens not to
    matter."""
    p = _pair(name, tmp_path_factory)
    moe, e = p.block.mlp, p.model.cfg.moe
    block_cls = {"mixtral": transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock}.get(
        name, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)
    assert type(p.hf.mlp) is block_cls
    assert (e.dispatch, e.score_func, e.num_shared_experts, e.aux_free_bias) == ("dropless", "softmax", 0, False)
    assert (e.num_experts, e.num_experts_per_token) == (EXPERTS, TOP_K)
    assert e.norm_topk_prob is (name != "qwen3_moe_unnormalized") and e.routed_scaling_factor == 1.0
    x = _hidden()
    tokens = torch.from_numpy(x).reshape(-1, HIDDEN)
    with torch.no_grad():
        hf_logits, hf_weights, hf_experts = p.hf.mlp.gate(tokens)
        expected = p.hf.mlp(torch.from_numpy(x))
    r = routing.route(jnp.asarray(x).reshape(-1, HIDDEN), moe.router[...], e)
    _close(r.logits, hf_logits, f"{block_cls.__name__} router logits")
    order = np.argsort(np.asarray(r.experts), axis=-1)
    hf_order = np.argsort(hf_experts.numpy(), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.experts), order, -1),
                                  np.take_along_axis(hf_experts.numpy(), hf_order, -1), err_msg="chosen experts")
    np.testing.assert_allclose(np.take_along_axis(np.asarray(r.weights), order, -1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, -1), rtol=RTOL, atol=ATOL,
                               err_msg="combine weights")
    y, stats = moe(jnp.asarray(x))
    assert float(stats["dropped"]) == 0
    _close(y, expected, f"{block_cls.__name__} output")
