"""RMSNorm, rotary embedding, GQA attention and the SwiGLU MLP, with logical axis names on every weight."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, head_dim
from jaxtron.model import fp8, kernels, remat
from jaxtron.model.attention import attention, cached_attention, xla_attention
from jaxtron.model.cache import CACHE_NAMES, LayerCache
from jaxtron.model.projection import Matmuls
from jaxtron.parallel import ring_attention
from jaxtron.parallel.sharding import constrain


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


def rope_head_dim(cfg: ModelConfig) -> int:
    """The channels RoPE rotates per head: head_dim, or MLA's qk_rope_head_dim (jaxtron/model/mla.py)."""
    return cfg.mla.qk_rope_head_dim if cfg.mla.kv_lora_rank else head_dim(cfg)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [rope_head_dim/2], with Llama-3.1 or YaRN scaling when configured (transformers'
    ``_compute_llama3_parameters`` / ``_compute_yarn_parameters``, in fp32 as they are)."""
    d = rope_head_dim(cfg)
    theta_pow = cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # theta^(2i/d)
    inv_freq = 1.0 / theta_pow
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
    elif rs.type == "yarn":
        inv_freq = _yarn_frequencies(theta_pow, d, cfg.rope_theta, rs)
    return inv_freq


def _yarn_frequencies(theta_pow: jax.Array, d: int, theta: float, rs) -> jax.Array:
    """YaRN's "NTK-by-parts": channel pair i keeps its frequency (extrapolates) when it turns more than beta_fast
    times over the original context, is divided by ``factor`` (interpolates) when it turns fewer than beta_slow
    times, and is blended linearly between. The channel bounds are floored/ceiled (transformers' default
    ``truncate``) and computed in Python floats, as transformers does."""
    def channel(rotations: float) -> float:  # the channel index whose wavelength fits `rotations` times
        return d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(channel(rs.beta_fast)), 0), min(math.ceil(channel(rs.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    # the same fp32 quantities transformers blends (1 / (factor * base^(2i/d)), not inv_freq / factor)
    return 1.0 / (rs.factor * theta_pow) * (1 - keep) + 1.0 / theta_pow * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 mscale ln(factor) + 1 (1 for factor <= 1): DeepSeek's
    ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What the cos/sin tables are multiplied by (transformers' ``attention_factor``, its rotary embedding's
    ``attention_scaling``): 1 without yarn; with yarn, the ratio of mscale's and mscale_all_dim's temperature
    terms when both are set (1 for DeepSeek-V3, whose softmax scale carries the temperature instead:
    :func:`jaxtron.model.mla.LatentAttention.scale`), else 0.1 ln(factor) + 1. Multiplying both q's and k's
    rotated channels by it scales their dot product by its square."""
    rs = cfg.rope_scaling
    if rs.type != "yarn":
        return 1.0
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


class Rope(NamedTuple):
    """What a layer needs to rotate q and k: positions [batch, seq] and inverse frequencies [head_dim/2] (the
    fused kernel's inputs), and the cos/sin tables [batch, seq, head_dim/2] computed from them once per forward
    (``rope_tables``) rather than once per layer."""
    positions: jax.Array
    inv_freq: jax.Array
    cos: Optional[jax.Array] = None
    sin: Optional[jax.Array] = None


def rope_tables(positions: jax.Array, inv_freq: jax.Array, factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin of positions * inv_freq, times ``factor`` (:func:`rope_attention_factor`): fp32
    [batch, seq, head_dim/2]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim] rotated by the tables of :func:`rope_tables`, in the rotate-half
    (Hugging Face) layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for the two halves of head_dim.
    Written with the halves as an axis of size 2 (swap = flip of that axis), not split + concatenate: no
    concatenate in the forward and no pads in the backward."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    cos, sin = cos[:, :, None, None, :], sin[:, :, None, None, :]
    swapped = jnp.flip(xf, axis=-2) * jnp.array([-1.0, 1.0], jnp.float32)[:, None]
    return (xf * cos + swapped * sin).reshape(x.shape).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim]; positions: [batch, seq]. Rotate-half (Hugging Face) layout."""
    return rotate(x, *rope_tables(positions, inv_freq))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Optional[Matmuls] = None):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, head_dim(cfg)
        pd = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.cfg = cfg
        self.wq = param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), std, pd)
        self.wk = param(rngs, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wv = param(rngs, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wo = param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), out_std, pd)
        self.matmuls = matmuls or Matmuls.here()
        self.recipe = fp8.Recipe.of(cfg, self.matmuls)
        self.recipe.add_histories(self, ("wq", "wk", "wv", "wo"))
        if cfg.qkv_bias:
            self.bq = param(rngs, (h, hd), ("heads", "head_dim"), 0.0, pd)
            self.bk = param(rngs, (kvh, hd), ("kv_heads", "head_dim"), 0.0, pd)
            self.bv = param(rngs, (kvh, hd), ("kv_heads", "head_dim"), 0.0, pd)
        if cfg.qk_norm:  # Qwen3: one [head_dim] scale each for q and k, shared by all heads
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)

    def __call__(self, x, rope: Rope, segment_ids, cache: Optional[LayerCache] = None):
        """[batch, seq, hidden] -> [batch, seq, hidden]; with ``cache`` (decoding), this chunk's k/v are written
        into the cache at ``cache.index`` and the queries attend over the whole cache: returns (out, (k, v))."""
        dt = x.dtype
        kv = {"h": "act_kv_heads"}  # one input: under FP8, quantized once for the three (fp8.Recipe.projects)
        q, k, v = self.recipe.projects(self, x, ("wq", "bsd,dhk->bshk"), ("wk", "bsd,dhk->bshk", kv),
                                       ("wv", "bsd,dhk->bshk", kv))
        if self.cfg.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        q, k, v = (remat.tag(a, name) for a, name in zip((q, k, v), remat.QKV))
        if self.cfg.qk_norm:  # before RoPE, as Qwen3; the KV cache then holds normalized, rotated keys
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.rope_impl == "pallas":
            q, k = kernels.rope(q, k, rope.positions, rope.inv_freq)
            factor = rope_attention_factor(self.cfg)
            if factor != 1.0:  # the kernel takes no table factor: scale its output (XLA fuses it into the next op)
                q, k = (x * jnp.asarray(factor, x.dtype) for x in (q, k))
        else:
            cos, sin = ((rope.cos, rope.sin) if rope.cos is not None else
                        rope_tables(rope.positions, rope.inv_freq, rope_attention_factor(self.cfg)))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            return self._attend_cache(q, k, v, cache)
        if self.cfg.attention_impl in ("xla", "pallas"):
            # the names say how a sequence split over 'context' is read (K/V gathered, passed round a ring, or
            # exchanged for heads); the xla causal mask is by position (the sequence may arrive reordered:
            # context parallelism's load balance), the flash kernel's by chunk (parallel/context_flash.py)
            scale = q.shape[-1] ** -0.5
            flash, attend = None, functools.partial(xla_attention, matmuls=self.matmuls)
            if self.cfg.attention_impl == "pallas":
                flash = kernels.flash_piece(scale)
                attend = lambda q, k, v, seg, scale, _: attention(q, k, v, seg, implementation="pallas",  # noqa: E731
                                                                  scale=scale)
            out = ring_attention.sequence_attention(q, k, v, segment_ids, rope.positions, scale, attend, flash)
        else:
            out = attention(q, k, v, segment_ids, implementation=self.cfg.attention_impl,
                            deterministic=self.cfg.deterministic_attention, matmuls=self.matmuls)
        out = remat.tag(constrain(out, ("act_batch", "act_seq", "act_heads", "act_head_dim")), remat.ATTENTION_OUT)
        return remat.tag(self.recipe.project(self, "wo", "bshk,hkd->bsd", out), remat.OUT_PROJ)

    def _attend_cache(self, q, k, v, cache: LayerCache):
        dt = q.dtype
        write = lambda buf, x: constrain(jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype),
                                                                      (0, cache.index, 0, 0)), CACHE_NAMES)
        k_cache, v_cache = write(cache.k, k), write(cache.v, v)
        out = cached_attention(q, k_cache.astype(dt), v_cache.astype(dt), cache.mask, q.shape[-1] ** -0.5,
                               self.matmuls)
        out = constrain(out, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        return self.recipe.project(self, "wo", "bshk,hkd->bsd", out), (k_cache, v_cache)


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Optional[Matmuls] = None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        pd = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), std, pd)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), std, pd)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_std, pd)
        self.mlp_impl = cfg.mlp_impl
        self.recipe = fp8.Recipe.of(cfg, matmuls or Matmuls.here())
        self.recipe.add_histories(self, ("w_gate", "w_up", "w_down"))

    def __call__(self, x):
        gate, up = self.recipe.projects(self, x, ("w_gate", "bsd,df->bsf"), ("w_up", "bsd,df->bsf"))
        h = kernels.swiglu(gate, up) if self.mlp_impl == "pallas" else jax.nn.silu(gate) * up
        h = constrain(h, ("act_batch", "act_seq", "act_mlp"))
        return self.recipe.project(self, "w_down", "bsf,fd->bsd", h)
