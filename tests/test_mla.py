"""Multi-head Latent Attention (jaxtron/model/mla.py, docs/mla.md).

- the module equals transformers' ``DeepseekV3Attention`` math (a float64 numpy transcription of it, with
  DeepSeek's interleaved RoPE and weights in Hugging Face's layout, mapped onto jaxtron's parameter names the
  way a converter must: rope channels reordered by ``rope_deinterleave_order``), with and without q_lora;
- fsdp 2 x context 2 (ring) x tensor 2 trains as one device does (losses of 3 steps with a non-zero learning
  rate, gradient norms and every gradient leaf, fp32, 1e-5), and so does the Triton flash kernel on one device
  (1e-4);
- decoding against the MLA cache (latents and rope keys, absorbed form) gives the logits of the full forward,
  and greedy generation with the cache equals recomputing the full forward at every step, on one device and
  with the heads split over parallel.tensor=2;
- bad MLA fields give one-line ConfigErrors naming the field.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import NONZERO_LR, assert_same_training, tiny_config, training_record
from jaxtron import config as config_lib
from jaxtron.model.layers import Rope, rope_frequencies, rope_tables
from jaxtron.model.mla import LATENT_NORM_EPS, LatentAttention, rope_deinterleave_order

H, N, R, V, C, Q = 4, 16, 8, 12, 32, 24  # heads, qk_nope, qk_rope, v, kv_lora, q_lora
MLA = ("model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
       "model.mla.v_head_dim=12", "model.num_heads=4", "model.num_kv_heads=4")


def _hf_attention(x, W, positions, theta, eps):
    """transformers' DeepseekV3Attention (rope_interleave=True, its default; eager, causal) in float64 numpy;
    ``W`` holds its weights in torch's [out, in] layout under its names."""
    rms = lambda t, w: t / np.sqrt(np.mean(t * t, -1, keepdims=True) + eps) * w  # noqa: E731
    b, s, _ = x.shape
    q = x @ W["q_proj"].T if "q_proj" in W else rms(x @ W["q_a_proj"].T, W["q_a_layernorm"]) @ W["q_b_proj"].T
    q = q.reshape(b, s, H, N + R)
    ckv = x @ W["kv_a_proj_with_mqa"].T
    latent, k_rot = rms(ckv[..., :C], W["kv_a_layernorm"]), ckv[..., None, C:]
    angles = positions[..., None] * (1.0 / theta ** (np.arange(0, R, 2) / R))
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]

    def rotate_interleaved(t):  # apply_rotary_pos_emb_interleave: pairs (0,1), (2,3), ... out in halves
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

    kv = (latent @ W["kv_b_proj"].T).reshape(b, s, H, N + V)
    key = np.concatenate([kv[..., :N], np.broadcast_to(rotate_interleaved(k_rot), (b, s, H, R))], -1)
    query = np.concatenate([q[..., :N], rotate_interleaved(q[..., N:])], -1)
    scores = np.einsum("bqhd,bkhd->bhqk", query, key) * (N + R) ** -0.5
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhv->bqhv", p, kv[..., N:]).reshape(b, s, H * V) @ W["o_proj"].T


def _to_jaxtron(W, d):
    """Hugging Face's MLA weights under jaxtron's names and shapes (docs/mla.md's table); the rope output
    channels reordered from interleaved pairs to rotate-half halves."""
    order = rope_deinterleave_order(R)
    rope_rows = lambda w: np.concatenate([w[..., :N], w[..., N:][..., order]], -1)  # noqa: E731
    kv_b = W["kv_b_proj"].T.reshape(C, H, N + V)
    out = {"wkv_a": W["kv_a_proj_with_mqa"][:C].T, "wk_rope": W["kv_a_proj_with_mqa"][C:][order].T,
           "kv_norm": W["kv_a_layernorm"], "wk_b": kv_b[..., :N], "wv_b": kv_b[..., N:],
           "wo": W["o_proj"].T.reshape(H, V, d)}
    if "q_proj" in W:
        out["wq"] = rope_rows(W["q_proj"].T.reshape(d, H, N + R))
    else:
        out.update(wq_a=W["q_a_proj"].T, q_norm=W["q_a_layernorm"],
                   wq_b=rope_rows(W["q_b_proj"].T.reshape(Q, H, N + R)))
    return out


@pytest.mark.parametrize("q_lora", [Q, 0], ids=["q_lora", "direct_q"])
def test_module_matches_deepseek_v3_attention(q_lora):
    cfg = tiny_config(*MLA, f"model.mla.q_lora_rank={q_lora}").model
    d = cfg.hidden_size
    rng = np.random.default_rng(0)
    shapes = {"kv_a_proj_with_mqa": (C + R, d), "kv_a_layernorm": (C,), "kv_b_proj": (H * (N + V), C),
              "o_proj": (d, H * V)}
    shapes.update({"q_a_proj": (Q, d), "q_a_layernorm": (Q,), "q_b_proj": (H * (N + R), Q)} if q_lora
                  else {"q_proj": (H * (N + R), d)})
    W = {k: rng.normal(0, 0.3, s) + (1.0 if k.endswith("layernorm") else 0.0) for k, s in shapes.items()}
    b, s = 2, 7
    x = rng.normal(size=(b, s, d))
    positions = np.broadcast_to(np.arange(s) + 3, (b, s))  # not starting at 0: RoPE must use them

    with nnx.use_eager_sharding(False):  # no mesh here: the logical names stay metadata
        module = LatentAttention(cfg, rngs=nnx.Rngs(0))
    for name, w in _to_jaxtron(W, d).items():
        target = getattr(module, name)
        target = target.scale if name.endswith("norm") else target
        assert target[...].shape == w.shape, name
        target[...] = jnp.asarray(w, jnp.float32)
    pos = jnp.asarray(positions, jnp.int32)
    inv_freq = rope_frequencies(cfg)
    rope = Rope(pos, inv_freq, *rope_tables(pos, inv_freq))
    out = nnx.jit(lambda m, x: m(x, rope, None))(module, jnp.asarray(x, jnp.float32))  # jitted: eager is slower
    expected = _hf_attention(x, W, positions.astype(np.float64), cfg.rope_theta, LATENT_NORM_EPS)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())


# ------------------------------------------------------------------------------------------ layouts


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def one_device():
    return training_record(tiny_config(*MLA, "model.mla.q_lora_rank=24", *NONZERO_LR, "parallel.data=1"),
                           jax.devices()[:1])


def test_fsdp_context_tensor_layout_trains_like_one_device(one_device):
    """fsdp 2 x context 2 (ring) x tensor 2: the heads split over tensor, the sequence over context, the
    weights over fsdp x context, all in one run."""
    layout = ("parallel.data=1", "parallel.fsdp=2", "parallel.context=2", "parallel.tensor=2",
              "parallel.context_impl=ring")
    cfg = tiny_config(*MLA, "model.mla.q_lora_rank=24", *NONZERO_LR, *layout)
    assert_same_training(training_record(cfg, jax.devices()), one_device)


def test_the_triton_kernel_runs_mla_heads_padded_to_its_width(one_device):
    """attention_impl=pallas (the Triton flash kernel, interpreted on CPU) takes powers of two: MLA's 16 + 8 = 24
    wide q/k heads and 12 wide values run padded to 32 and sliced back, and train as the xla reference does
    (the kernel's online softmax sums in another order: 1e-4)."""
    from jaxtron.model import kernels

    assert kernels.padded_head_dim(24, "pallas") == 32 and kernels.padded_head_dim(192, "pallas") == 256
    assert kernels.padded_head_dim(192, "cudnn") == 192
    cfg = tiny_config(*MLA, "model.mla.q_lora_rank=24", *NONZERO_LR, "parallel.data=1", "model.attention_impl=pallas")
    assert_same_training(training_record(cfg, jax.devices()[:1]), one_device, rtol=1e-4)


# ------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def model():
    from jaxtron.model.llama import Llama

    cfg = tiny_config(*MLA, "model.mla.q_lora_rank=24", "model.initializer_range=0.2")
    return Llama(cfg.model, rngs=nnx.Rngs(1))


def test_cache_holds_latents_and_cached_logits_equal_full_forward(model):
    from jaxtron.model.cache import init_cache

    cfg = model.cfg
    cache = init_cache(cfg, 2, 12)
    assert cache.k.shape == (cfg.num_layers, 2, 12, C) and cache.v.shape == (cfg.num_layers, 2, 12, R)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    full = model(tokens, positions)
    graphdef, state = nnx.split(model)
    cached = jax.jit(lambda st, *a: nnx.merge(graphdef, st).forward_cached(*a))
    start = jnp.zeros((2,), jnp.int32)
    prefill, cache = cached(state, tokens[:, :6], positions[:, :6], cache, 0, start)  # a prompt, then 3 steps
    steps = [prefill]
    for i in range(6, 9):
        logits, cache = cached(state, tokens[:, i:i + 1], positions[:, i:i + 1], cache, i, start)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def test_greedy_generation_with_cache_equals_recomputing(model):
    """One device with the cache, one device recomputing the full forward at every step, and the cache with the
    heads split over parallel.tensor=2 (the absorbed products per head shard, the latents replicated)."""
    from jaxtron.generate import generate, generate_no_cache
    from jaxtron.preflight import inference_layout

    prompts = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]]  # different lengths: left padding
    cached = generate(model, prompts, max_new_tokens=8)
    full = generate_no_cache(model, prompts, max_new_tokens=8)
    np.testing.assert_array_equal(cached.tokens, full.tokens)
    assert len(set(cached.tokens[0].tolist())) > 1, "a constant generation would not test the cache"
    layout = inference_layout(model.cfg, ["parallel.tensor=2"])
    sharded = layout.place(model)
    assert sharded.layers.attention.wk_b[...].addressable_shards[0].data.shape[2] == H // 2  # heads split
    np.testing.assert_array_equal(generate(sharded, prompts, max_new_tokens=8, layout=layout).tokens, cached.tokens)


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("override,field", [
    ("model.mla.qk_rope_head_dim=7", "model.mla.qk_rope_head_dim"),
    ("model.mla.v_head_dim=0", "model.mla.v_head_dim"),
    ("model.mla.q_lora_rank=-1", "model.mla.q_lora_rank"),
    ("model.rope_impl=pallas", "model.rope_impl"),
])
def test_bad_mla_config_is_one_line_naming_the_field(override, field):
    with pytest.raises(config_lib.ConfigError) as err:
        tiny_config(*MLA, override)
    assert field in str(err.value) and "\n" not in str(err.value)
