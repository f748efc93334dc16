"""Incremental (KV-cached) forward of :class:`jaxtron.model.llama.Llama`, for text generation.

The training forward (``Llama.__call__``) is untouched. This module runs the same network one chunk of
tokens at a time against a fixed-size cache, reading the weights from the NNX model itself: the stacked
decoder blocks are split (``nnx.split(model.layers)``) and scanned exactly as the training forward scans
them, and each block's own ``attn_norm`` / ``mlp_norm`` (RMSNorm) and ``mlp`` (SwiGLU) modules are called
as they are. Only attention differs: q/k/v are projected with the block's ``wq/wk/wv`` (+ Qwen2 biases),
rotated with :func:`jaxtron.model.layers.apply_rope` and :func:`~jaxtron.model.layers.rope_frequencies`,
written into the cache, and attended against the whole cache under an explicit mask (GQA without repeating
K/V, fp32 softmax, as ``attention.xla_attention`` does).

    cache = init_cache(model.cfg, batch, max_len)
    logits, cache = forward_cached(model, tokens, positions, cache, index, start)

Cache layout: ``k`` and ``v`` are ``[layers, batch, max_len, kv_heads, head_dim]`` in the compute dtype.
``tokens``/``positions`` ``[batch, s]`` are written at cache slots ``index .. index+s-1`` (the same slots for
every row: prompts are left-padded). ``start [batch]`` is the first slot of each row holding a real token;
slots before it (left padding) are never attended to. Query ``i`` of the chunk sees slots
``start <= t <= index + i``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, compute_dtype, head_dim
from jaxtron.model.layers import apply_rope, rope_frequencies


class KVCache(NamedTuple):
    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dt = jnp.dtype(dtype or compute_dtype(cfg))
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, head_dim(cfg))
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def cache_mask(start: jax.Array, index, seq: int, max_len: int) -> jax.Array:
    """[batch, seq, max_len] bool: query ``i`` (at slot ``index + i``) may attend to slot ``t``."""
    t = jnp.arange(max_len, dtype=jnp.int32)
    q_slot = index + jnp.arange(seq, dtype=jnp.int32)
    causal = t[None, :] <= q_slot[:, None]  # [seq, max_len]
    valid = t[None, :] >= start[:, None]    # [batch, max_len]
    return causal[None] & valid[:, None, :]


def cached_attention(q, k, v, mask, scale: float) -> jax.Array:
    """q [b, s, h, d]; k, v [b, T, kvh, d] (the whole cache); mask [b, s, T]. Same math as xla_attention."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)


def _attention_step(attn, x, positions, inv_freq, k_cache, v_cache, index, mask):
    """One block's attention for a chunk ``x [b, s, d]``: project with the block's weights, RoPE, write the
    chunk's k/v into this layer's cache at ``index``, attend over the cache. Returns (out, k_cache, v_cache)."""
    cfg = attn.cfg
    dt = x.dtype
    q = jnp.einsum("bsd,dhk->bshk", x, attn.wq[...].astype(dt))
    k = jnp.einsum("bsd,dhk->bshk", x, attn.wk[...].astype(dt))
    v = jnp.einsum("bsd,dhk->bshk", x, attn.wv[...].astype(dt))
    if cfg.qkv_bias:
        q, k, v = q + attn.bq[...].astype(dt), k + attn.bk[...].astype(dt), v + attn.bv[...].astype(dt)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, index, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, index, 0, 0))
    out = cached_attention(q, k_cache.astype(dt), v_cache.astype(dt), mask, head_dim(cfg) ** -0.5)
    return jnp.einsum("bshk,hkd->bsd", out, attn.wo[...].astype(dt)), k_cache, v_cache


def forward_cached(model, tokens: jax.Array, positions: jax.Array, cache: KVCache, index, start: jax.Array
                   ) -> tuple[jax.Array, KVCache]:
    """Logits ``[batch, s, vocab]`` (fp32) of ``tokens [batch, s]`` at cache slots ``index..index+s-1``
    (RoPE ``positions [batch, s]``), and the updated cache. See the module docstring for ``start``."""
    cfg = model.cfg
    index = jnp.asarray(index, jnp.int32)
    x = model.embed_tokens(tokens)
    inv_freq = rope_frequencies(cfg)
    mask = cache_mask(start.astype(jnp.int32), index, tokens.shape[1], cache.k.shape[2])

    graphdef, state = nnx.split(model.layers)

    def block(x, xs):
        layer_state, k_l, v_l = xs
        layer = nnx.merge(graphdef, layer_state)
        a, k_l, v_l = _attention_step(layer.attention, layer.attn_norm(x), positions, inv_freq, k_l, v_l,
                                      index, mask)
        x = x + a
        x = x + layer.mlp(layer.mlp_norm(x))
        return x, (k_l, v_l)

    x, (k, v) = jax.lax.scan(block, x, (state, cache.k, cache.v))
    return model.logits(x), KVCache(k, v)
