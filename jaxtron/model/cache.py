"""The KV cache of generation: per layer ``k``/``v`` buffers the training ``Attention`` writes a chunk into and
attends over (``Llama.forward_cached``). Same modules, kernels' projections and sharding constraints as
training; the cache's kv-heads axis is split as K/V are (``act_kv_heads``).

Cache layout: ``k`` and ``v`` are ``[layers, batch, max_len, kv_heads, head_dim]`` in the compute dtype. A
Multi-head Latent Attention model (``model.mla.kv_lora_rank > 0``, :mod:`jaxtron.model.mla`) caches less:
``k`` holds each token's compressed latent ``[layers, batch, max_len, kv_lora_rank]`` and ``v`` its rotated
key shared by all heads ``[layers, batch, max_len, qk_rope_head_dim]``.
``tokens``/``positions`` ``[batch, s]`` are written at cache slots ``index .. index+s-1`` (the same slots for
every row: prompts are left-padded). ``start [batch]`` is the first slot of each row holding a real token;
slots before it (left padding) are never attended to. Query ``i`` of the chunk sees slots
``start <= t <= index + i``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtron.config import ModelConfig, compute_dtype, head_dim

CACHE_NAMES = ("act_batch", None, "act_kv_heads", "act_head_dim")   # one layer's [batch, max_len, kv, d]
LATENT_CACHE_NAMES = ("act_batch", None, "act_kv_lora")             # MLA: one layer's latents [batch, max_len, c]
ROPE_KEY_CACHE_NAMES = ("act_batch", None, "act_head_dim")          # MLA: its rotated keys [batch, max_len, r]


class KVCache(NamedTuple):
    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]; MLA: [layers, batch, max_len, kv_lora_rank]
    v: jax.Array  # MLA: [layers, batch, max_len, qk_rope_head_dim]


class LayerCache(NamedTuple):
    """What one layer's attention reads and writes during cached decoding."""

    k: jax.Array      # [batch, max_len, kv_heads, head_dim]
    v: jax.Array
    index: jax.Array  # first slot this chunk writes
    mask: jax.Array   # [batch, chunk, max_len] bool: which slots each query sees


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dt = jnp.dtype(dtype or compute_dtype(cfg))
    if cfg.mla.kv_lora_rank:
        rows = (cfg.num_layers, batch, max_len)
        return KVCache(jnp.zeros(rows + (cfg.mla.kv_lora_rank,), dt), jnp.zeros(rows + (cfg.mla.qk_rope_head_dim,), dt))
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, head_dim(cfg))
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def cache_mask(start: jax.Array, index, seq: int, max_len: int) -> jax.Array:
    """[batch, seq, max_len] bool: query ``i`` (at slot ``index + i``) may attend to slot ``t``."""
    t = jnp.arange(max_len, dtype=jnp.int32)
    q_slot = index + jnp.arange(seq, dtype=jnp.int32)
    causal = t[None, :] <= q_slot[:, None]  # [seq, max_len]
    valid = t[None, :] >= start[:, None]    # [batch, max_len]
    return causal[None] & valid[:, None, :]
