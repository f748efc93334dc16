"""RMSNorm, rotary embedding, GQA attention and the SwiGLU MLP, with logical axis names on every weight."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, head_dim
from jaxtron.model.attention import attention
from jaxtron.parallel.sharding import constrain, kernel_interpret, per_shard


def param(rngs: nnx.Rngs, shape, names, std: float, dtype) -> nnx.Param:
    init = nnx.initializers.normal(std) if std > 0 else nnx.initializers.zeros_init()
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [head_dim/2], with Llama-3.1 frequency-dependent scaling when configured."""
    d = head_dim(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling
    if rs.type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
        inv_freq = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor,
                             jnp.where(wavelen < high_wavelen, inv_freq, smoothed))
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim]; positions: [batch, seq]. Rotate-half (Hugging Face) layout."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [b, s, d/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def pallas_rope(q, k, positions, inv_freq):
    """The fused q/k RoPE kernel (``pallas_kernels.apply_rope``), per shard."""
    from pallas_kernels.rope import apply_rope as fused_rope
    q_names = ("act_batch", "act_seq", "act_heads", None)
    k_names = ("act_batch", "act_seq", "act_kv_heads", None)
    kernel = functools.partial(fused_rope, interpret=kernel_interpret())
    return per_shard(kernel, (q_names, k_names, ("act_batch", "act_seq"), (None,)),
                     [q_names, k_names])(q, k, positions.astype(jnp.int32), inv_freq)


def pallas_swiglu(gate, up):
    """silu(gate) * up with the fused kernel (``pallas_kernels.swiglu``), per shard."""
    from pallas_kernels.swiglu import swiglu
    names = ("act_batch", "act_seq", "act_mlp")
    return per_shard(functools.partial(swiglu, interpret=kernel_interpret()), (names, names), names)(gate, up)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, head_dim(cfg)
        pd = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.cfg = cfg
        self.wq = param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), std, pd)
        self.wk = param(rngs, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wv = param(rngs, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wo = param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), out_std, pd)
        if cfg.qkv_bias:
            self.bq = param(rngs, (h, hd), ("heads", "head_dim"), 0.0, pd)
            self.bk = param(rngs, (kvh, hd), ("kv_heads", "head_dim"), 0.0, pd)
            self.bv = param(rngs, (kvh, hd), ("kv_heads", "head_dim"), 0.0, pd)

    def __call__(self, x, positions, segment_ids, inv_freq):
        dt = x.dtype
        q = jnp.einsum("bsd,dhk->bshk", x, self.wq[...].astype(dt))
        k = jnp.einsum("bsd,dhk->bshk", x, self.wk[...].astype(dt))
        v = jnp.einsum("bsd,dhk->bshk", x, self.wv[...].astype(dt))
        if self.cfg.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        if self.cfg.rope_impl == "pallas":
            q, k = pallas_rope(q, k, positions, inv_freq)
        else:
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out = attention(q, k, v, segment_ids, implementation=self.cfg.attention_impl)
        out = constrain(out, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        return jnp.einsum("bshk,hkd->bsd", out, self.wo[...].astype(dt))


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        pd = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), std, pd)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), std, pd)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_std, pd)
        self.mlp_impl = cfg.mlp_impl

    def __call__(self, x):
        dt = x.dtype
        gate = jnp.einsum("bsd,df->bsf", x, self.w_gate[...].astype(dt))
        up = jnp.einsum("bsd,df->bsf", x, self.w_up[...].astype(dt))
        h = pallas_swiglu(gate, up) if self.mlp_impl == "pallas" else jax.nn.silu(gate) * up
        h = constrain(h, ("act_batch", "act_seq", "act_mlp"))
        return jnp.einsum("bsf,fd->bsd", h, self.w_down[...].astype(dt))
