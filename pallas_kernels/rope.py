"""Rotary position embedding (rotate-half / Hugging Face convention) as a Pallas kernel.

Public API:
  apply_rope(q, k, positions, inv_freq, *, interpret=None, block_seq=64, backend="triton") -> (q_rot, k_rot)
  rope_inv_freq(head_dim, theta, llama3_scaling=None) -> inv_freq [head_dim/2] fp32
  rope_reference(x, positions, inv_freq) -> x_rot   (plain jnp)

Design:
  * One pallas_call per tensor (q and k each get their own launch), so GQA (kv_heads != heads) needs nothing special.
  * Grid (batch, seq_blocks, heads); each program loads a [block_seq, head_dim] tile of one head plus the
    [block_seq] positions and the full [head_dim/2] inv_freq, computes angles = pos * inv_freq, cos/sin in fp32,
    and writes concat(x1*cos - x2*sin, x2*cos + x1*sin) in the input dtype.  The two halves are read/written
    through static ref slices, so head_dim/2 must be a power of two for the Triton lowering (64 and 128 are fine).
  * Ragged sequence lengths: the wrapper pads seq up to a multiple of the block (positions padded with 0) and
    slices the result.
  * Backward (jax.custom_vjp) is the same kernel run with sign=-1, i.e. rotation by -angle (the transpose of a
    rotation).  positions and inv_freq get zero cotangents (inv_freq is treated as a constant).
  * `backend` dispatches through _IMPLS; only "triton" exists, a Mosaic GPU variant can be added beside it.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._common import cdiv, check_backend, is_pow2, pick_block, resolve_interpret

__all__ = ["apply_rope", "rope_inv_freq", "rope_reference", "head_dim_supported"]


def head_dim_supported(d: int) -> bool:
    """Whether the Triton kernel takes this head_dim: even, with head_dim/2 a power of two (64 and 128 are)."""
    return d % 2 == 0 and is_pow2(d // 2)


# ----------------------------------------------------------------------------------------------------------------
# Frequencies and reference
# ----------------------------------------------------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, llama3_scaling: Mapping | None = None) -> jax.Array:
    """inv_freq [head_dim/2] fp32, optionally with Llama-3.1 scaling (Hugging Face `_compute_llama3_parameters`).

    llama3_scaling: mapping with keys factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    (an HF `rope_scaling` dict; extra keys such as rope_type are ignored).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim}")
    inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    inv_freq = inv_freq.astype(np.float32)
    if llama3_scaling is not None:
        factor = float(llama3_scaling["factor"])
        low = float(llama3_scaling["low_freq_factor"])
        high = float(llama3_scaling["high_freq_factor"])
        old_ctx = float(llama3_scaling["original_max_position_embeddings"])
        if high <= low:
            raise ValueError(f"high_freq_factor ({high}) must be > low_freq_factor ({low})")
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = (np.float32(old_ctx) / wavelen - np.float32(low)) / np.float32(high - low)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    return jnp.asarray(inv_freq, jnp.float32)


def rope_reference(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [batch, seq, heads, head_dim]; positions [batch, seq]. fp32 math, output in x.dtype."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq.astype(jnp.float32)  # [b, s, d/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton-backend kernel
# ----------------------------------------------------------------------------------------------------------------

def _rope_kernel(x_ref, pos_ref, freq_ref, o_ref, *, half: int, sign: float):
    pos = pos_ref[...].astype(jnp.float32)            # [bs]
    freq = freq_ref[...].astype(jnp.float32)          # [half]
    angles = pos[:, None] * freq[None, :]             # [bs, half]
    cos = jnp.cos(angles)
    sin = jnp.sin(angles)
    if sign < 0:
        sin = -sin
    x1 = x_ref[:, pl.ds(0, half)].astype(jnp.float32)     # [bs, half]
    x2 = x_ref[:, pl.ds(half, half)].astype(jnp.float32)
    o_ref[:, pl.ds(0, half)] = (x1 * cos - x2 * sin).astype(o_ref.dtype)
    o_ref[:, pl.ds(half, half)] = (x2 * cos + x1 * sin).astype(o_ref.dtype)


def _rope_triton(x, positions, inv_freq, *, sign: float, interpret: bool, block_seq: int,
                 num_warps: int = 4, num_stages: int = 1):
    b, s, h, d = x.shape
    half = d // 2
    bs = pick_block(block_seq, s, "block_seq")
    s_pad = cdiv(s, bs) * bs
    if s_pad != s:
        x = jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
        positions = jnp.pad(positions, ((0, 0), (0, s_pad - s)))
    sq = pl.squeezed
    out = pl.pallas_call(
        functools.partial(_rope_kernel, half=half, sign=sign),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(b, s_pad // bs, h),
        in_specs=[
            pl.BlockSpec((sq, bs, sq, d), lambda i, j, k: (i, j, k, 0)),
            pl.BlockSpec((sq, bs), lambda i, j, k: (i, j)),
            pl.BlockSpec((half,), lambda i, j, k: (0,)),
        ],
        out_specs=pl.BlockSpec((sq, bs, sq, d), lambda i, j, k: (i, j, k, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rope_fwd" if sign > 0 else "rope_bwd",
    )(x, positions.astype(jnp.int32), inv_freq.astype(jnp.float32))
    return out[:, :s] if s_pad != s else out


_IMPLS = {"triton": _rope_triton}


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp wrapper and public function
# ----------------------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rope(x, positions, inv_freq, backend, interpret, block_seq):
    return _IMPLS[backend](x, positions, inv_freq, sign=1.0, interpret=interpret, block_seq=block_seq)


def _rope_fwd(x, positions, inv_freq, backend, interpret, block_seq):
    out = _IMPLS[backend](x, positions, inv_freq, sign=1.0, interpret=interpret, block_seq=block_seq)
    return out, (positions, inv_freq)


def _rope_bwd(backend, interpret, block_seq, res, g):
    positions, inv_freq = res
    dx = _IMPLS[backend](g, positions, inv_freq, sign=-1.0, interpret=interpret, block_seq=block_seq)
    d_pos = np.zeros(positions.shape, dtype=jax.dtypes.float0)
    return dx, d_pos, jnp.zeros_like(inv_freq)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _validate(q, k, positions, inv_freq):
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [batch, seq, heads, head_dim]; got q{q.shape}, k{k.shape}")
    b, s, h, d = q.shape
    kb, ks, kh, kd = k.shape
    if (kb, ks, kd) != (b, s, d):
        raise ValueError(f"k {k.shape} must match q {q.shape} in batch, seq and head_dim")
    if kh <= 0 or h % kh:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({kh})")
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if not head_dim_supported(d):
        raise ValueError(f"head_dim/2 must be a power of two for the Triton kernel, got head_dim={d}")
    if positions.shape != (b, s):
        raise ValueError(f"positions must be [batch, seq] = {(b, s)}, got {positions.shape}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer array, got {positions.dtype}")
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"inv_freq must be [head_dim/2] = {(d // 2,)}, got {inv_freq.shape}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")


def apply_rope(q, k, positions, inv_freq, *, interpret: bool | None = None, block_seq: int = 64,
               backend: str = "triton"):
    """Rotate q [b, s, h, d] and k [b, s, kv_h, d] by angles positions[b, s] * inv_freq[d/2] (fp32 math).

    Returns (q_rot, k_rot) in the input dtype. Differentiable w.r.t. q and k (Pallas backward kernel).
    interpret=None -> interpret on the CPU backend. One pallas_call per tensor.
    """
    check_backend(backend, _IMPLS, "apply_rope")
    _validate(q, k, positions, inv_freq)
    interp = resolve_interpret(interpret)
    pick_block(block_seq, q.shape[1], "block_seq")  # validate early
    positions = positions.astype(jnp.int32)
    inv_freq = inv_freq.astype(jnp.float32)
    return (_rope(q, positions, inv_freq, backend, interp, block_seq),
            _rope(k, positions, inv_freq, backend, interp, block_seq))
