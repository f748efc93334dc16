"""Block-scaled FP8 matmul (DeepSeek-V3's fine-grained FP8 GEMM) as a Pallas Triton kernel.

Public API:
  blockwise_matmul(a [M, K], a_scale [K/B, M], b [K, N], b_scale [K/B, N], *, block=128, out_dtype=float32,
                   tiles=(128, 128), num_warps=4, num_stages=3, interpret=None) -> [M, N]
  blockwise_matmul_reference(same) -> [M, N] in jnp

Semantics: a and b are FP8 (float8_e4m3fn or float8_e5m2) and K is a multiple of B; every block of B along K
has its own scales, one per row of a and one per column of b:

  out[m, n] = sum_kb a_scale[kb, m] * b_scale[kb, n] * sum_{k in block kb} a[m, k] * b[k, n]

The inner sums are FP8 x FP8 dots with fp32 accumulation; the scales multiply each block's partial product in
fp32 before it joins the accumulator (DeepSeek-V3's "promotion" every 128 K). That covers all three GEMMs of a
block-scaled linear layer: the forward (1 x B activation tiles, a B x B weight tile's scale repeated over its B
columns), dgrad (the gradient's 1 x B tiles, the weight transposed) and wgrad (activations and gradient both
in B x 1 tiles along the tokens, the contraction). XLA:GPU (in the jax versions jaxtron supports) does not lower
this to a Hopper GEMM with per-block scales inside the contraction: its FP8 GEMMs take one scale per operand,
and its block-scaled dots go to cuDNN on Blackwell; cuBLASLt 12.9 added 1 x 128 / 128 x 128 block scaling on
Hopper, which XLA does not emit. Hence this kernel.

Design: a grid of (M / tm, N / tn) output tiles; each program loops over the K / B blocks, loading a (tm, B)
and a (B, tn) FP8 tile and the block's tm + tn scales. Scales are laid out [K/B, M] and [K/B, N] so that one
block's scales are a contiguous row. M and N are zero-padded to the tiles inside the wrapper and the result
sliced back. No backward: the caller (jaxtron.model.fp8) builds the layer's gradient from three forward calls
on freshly quantized operands. On CPU the kernel runs in Pallas interpret mode (interpret=None selects it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._common import cdiv, pick_block, resolve_interpret

__all__ = ["blockwise_matmul", "blockwise_matmul_reference", "FP8_DTYPES"]

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _check(a, a_scale, b, b_scale, block: int) -> None:
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"blockwise_matmul: a is [{m}, {k}] but b is [{k2}, {n}]")
    for name, x in (("a", a), ("b", b)):
        if x.dtype not in FP8_DTYPES:
            raise ValueError(f"blockwise_matmul: {name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
    if k % block:
        raise ValueError(f"blockwise_matmul: K={k} is not a multiple of block={block}")
    if a_scale.shape != (k // block, m) or b_scale.shape != (k // block, n):
        raise ValueError(f"blockwise_matmul: scales must be [{k // block}, {m}] and [{k // block}, {n}], got "
                         f"{list(a_scale.shape)} and {list(b_scale.shape)}")


def blockwise_matmul_reference(a, a_scale, b, b_scale, *, block: int = 128, out_dtype=jnp.float32):
    """The semantics in jnp: each block's FP8 dot in fp32, scaled, summed over blocks (XLA's own ops)."""
    _check(a, a_scale, b, b_scale, block)
    (m, k), n = a.shape, b.shape[1]
    a3 = a.reshape(m, k // block, block)
    b3 = b.reshape(k // block, block, n)
    parts = jnp.einsum("mqk,qkn->qmn", a3, b3, preferred_element_type=jnp.float32)
    out = jnp.einsum("qmn,qm,qn->mn", parts, a_scale.astype(jnp.float32), b_scale.astype(jnp.float32))
    return out.astype(out_dtype)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, tm, tn, block, k_blocks):
    m_sl = pl.ds(pl.program_id(0) * tm, tm)
    n_sl = pl.ds(pl.program_id(1) * tn, tn)

    def body(kb, acc):
        k_sl = pl.ds(kb * block, block)
        part = jnp.dot(a_ref[m_sl, k_sl], b_ref[k_sl, n_sl], preferred_element_type=jnp.float32)
        sa = sa_ref[pl.ds(kb, 1), m_sl]   # [1, tm]
        sb = sb_ref[pl.ds(kb, 1), n_sl]   # [1, tn]
        return acc + part * jnp.transpose(sa) * sb

    acc = lax.fori_loop(0, k_blocks, body, jnp.zeros((tm, tn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("block", "out_dtype", "tiles", "num_warps", "num_stages",
                                             "interpret"))
def blockwise_matmul(a, a_scale, b, b_scale, *, block: int = 128, out_dtype=jnp.float32, tiles=(128, 128),
                     num_warps: int = 4, num_stages: int = 3, interpret=None):
    """``out = sum_kb a_scale[kb, :, None] * b_scale[kb] * (a[:, kb] @ b[kb])`` (module doc), [M, N] in
    ``out_dtype``."""
    _check(a, a_scale, b, b_scale, block)
    pick_block(block, block, "block")
    (m, k), n = a.shape, b.shape[1]
    tm, tn = pick_block(tiles[0], m, "tiles[0]"), pick_block(tiles[1], n, "tiles[1]")
    tm, tn = max(tm, 16), max(tn, 16)  # Triton dots need every dimension >= 16
    mp, np_ = cdiv(m, tm) * tm, cdiv(n, tn) * tn
    a, a_scale = _pad(a, 0, mp), _pad(a_scale.astype(jnp.float32), 1, mp)
    b, b_scale = _pad(b, 1, np_), _pad(b_scale.astype(jnp.float32), 1, np_)
    kernel = functools.partial(_kernel, tm=tm, tn=tn, block=block, k_blocks=k // block)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0, 0))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(mp // tm, np_ // tn),
        in_specs=[whole(a.shape), whole(a_scale.shape), whole(b.shape), whole(b_scale.shape)],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=resolve_interpret(interpret),
        name="fp8_blockwise_matmul",
    )(a, a_scale, b, b_scale)
    return out[:m, :n]
