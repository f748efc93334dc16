"""Blockwise FP8 (``model.fp8=blockwise``): DeepSeek-V3's fine-grained scaling for the dense projections.

Every tile has its own fp32 scale (its amax over the e4m3 maximum): activations and gradients in 1 x B tiles
along the contraction, weights in B x B tiles (B = ``model.fp8_block``, 128 as in DeepSeek-V3 and Megatron's
blockwise recipe). With one outlier costing only its own tile's precision, the gradients are e4m3 too, as in
DeepSeek-V3 (tensorwise recipes need e5m2's range for them). A projection ``einsum(spec, x, w)`` runs as the
2-D matmul [M, K] x [K, N] (M: x's axes the weight lacks, K: the contracted axes, N: the weight's own) in
three block-scaled GEMMs (``pallas_kernels.fp8_blockwise``):

- forward: x in 1 x B tiles along K, w in B x B tiles (each tile's scale repeated over its B columns);
- dgrad: the gradient in 1 x B tiles along N, the same FP8 weight transposed;
- wgrad: x (dequantized from its saved FP8 copy) and the gradient requantized in B x 1 tiles along the tokens,
  which dgrad's and the forward's tiles are not: a GEMM's scales must be constant along its contraction.

The weight is quantized before the matmul's shard_map, so under FSDP its all-gather moves FP8 bytes (and the
B x B scales); the rest runs on each device's blocks (``parallel.sharding.per_shard_2d``), where every tile
lies inside one device's shard (config validation requires the split axes to be multiples of B), so the tiles
and their scales are those of one device, and a layout trains as one device does. With
``model.fp8_blockwise_impl=pallas`` the GEMMs are the Triton kernel (the only way to a Hopper GEMM with scales
inside the contraction); ``xla`` runs the kernel's jnp reference with the same sums, without a speed-up on GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxtron.model import kernels
from jaxtron.model.projection import parse_spec

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)

# logical names of the axes of the projections' einsum specs ("bsd,dhk->bshk", "bsf,fd->bsd", ...)
LETTER_NAMES = {"b": "act_batch", "s": "act_seq", "d": "act_embed", "h": "act_heads", "k": "act_head_dim",
                "f": "act_mlp"}


@dataclasses.dataclass(frozen=True)
class Blockwise:
    block: int = 128
    impl: str = "xla"                    # 'xla' | 'pallas'
    names: tuple = tuple(LETTER_NAMES.items())


def tile_quantize(x, tile: tuple[int, int]):
    """x [R, C] (R, C multiples of the tile) in e4m3 tiles: (q [R, C], scales [R / tr, C / tc] fp32), each
    scale its tile's amax / 448 (1 for an all-zero tile)."""
    (r, c), (tr, tc) = x.shape, tile
    t = x.astype(jnp.float32).reshape(r // tr, tr, c // tc, tc)
    amax = jnp.max(jnp.abs(t), axis=(1, 3))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(t / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q.reshape(r, c), scale


def tile_dequantize(q, scale, tile: tuple[int, int]):
    (r, c), (tr, tc) = q.shape, tile
    t = q.astype(jnp.float32).reshape(r // tr, tr, c // tc, tc) * scale[:, None, :, None]
    return t.reshape(r, c)


def _pad_rows(x, block: int):
    extra = -x.shape[0] % block
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


def _fwd_local(sum_over, x2, wq, sw, *, opts: Blockwise, out_dtype):
    b = opts.block
    xq, sx = tile_quantize(x2, (1, b))
    gemm = kernels.blockwise_gemm(opts.impl, b)
    y = gemm(xq, sx.T, wq, jnp.repeat(sw, b, axis=1), out_dtype)
    return sum_over(y, "k"), xq, sx


def _dgrad_local(sum_over, g2, wq, sw, *, opts: Blockwise, out_dtype):
    b = opts.block
    gq, sg = tile_quantize(g2, (1, b))
    gemm = kernels.blockwise_gemm(opts.impl, b)
    return (sum_over(gemm(gq, sg.T, wq.T, jnp.repeat(sw.T, b, axis=1), out_dtype), "n"),)


def _wgrad_local(sum_over, xq, sx, g2, *, opts: Blockwise, out_dtype):
    b = opts.block
    x = _pad_rows(tile_dequantize(xq, sx, (1, b)), b)   # zero rows: no tile's amax moves, no product changes
    xtq, sxt = tile_quantize(x, (b, 1))
    gq, sg = tile_quantize(_pad_rows(g2.astype(jnp.float32), b), (b, 1))
    gemm = kernels.blockwise_gemm(opts.impl, b)
    return (sum_over(gemm(xtq.T, sxt, gq, sg, out_dtype), "m"),)


def _letters(spec: str):
    xs, ws, out = parse_spec(spec)
    m = "".join(c for c in xs if c not in ws)
    k = "".join(c for c in xs if c in ws)
    n = "".join(c for c in ws if c not in xs)
    return xs, ws, out, m, k, n


def _dims(spec: str, opts: Blockwise) -> dict:
    names = dict(opts.names)
    _, _, _, m, k, n = _letters(spec)
    return {"m": tuple(names[c] for c in m), "k": tuple(names[c] for c in k), "n": tuple(names[c] for c in n)}


def _local(fn, spec, opts, in_dims, out_dims, out_dtype):
    """``fn`` per device (the Pallas kernel) or on the whole arrays (XLA's ops, partitioned by XLA)."""
    body = functools.partial(fn, opts=opts, out_dtype=out_dtype)
    if opts.impl != "pallas":
        return functools.partial(body, lambda x, letter: x)
    from jaxtron.parallel.sharding import per_shard_2d

    return per_shard_2d(body, _dims(spec, opts), in_dims, out_dims)


def _to_2d(x, letters_in: str, rows: str, cols: str):
    """x with axes ``letters_in`` transposed to (rows, cols) and merged into a matrix."""
    perm = [letters_in.index(c) for c in rows + cols]
    xt = jnp.transpose(x, perm)
    return xt.reshape(math.prod(xt.shape[:len(rows)]), -1), xt.shape


def _from_2d(y2, shape, letters: str, target: str):
    y = y2.reshape(shape)
    return jnp.transpose(y, [letters.index(c) for c in target])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def blockwise_project(spec: str, x: jax.Array, w: jax.Array, opts: Blockwise) -> jax.Array:
    """``einsum(spec, x, w)`` (``w`` a weight) with blockwise FP8 scaling (module doc); result in x's dtype,
    gradients in x's and w's dtypes."""
    return _bw_fwd(spec, x, w, opts)[0]


def _bw_fwd(spec, x, w, opts):
    xs, ws, ys, m, k, n = _letters(spec)
    x2, _ = _to_2d(x, xs, m, k)
    w2, _ = _to_2d(w, ws, k, n)
    wq, sw = tile_quantize(w2, (opts.block, opts.block))
    fwd = _local(_fwd_local, spec, opts, ("mk", "kn", "kn"), ("mn", "mk", "mk"), x.dtype)
    y2, xq, sx = fwd(x2, wq, sw)
    y_shape = tuple(x.shape[xs.index(c)] for c in m) + tuple(w.shape[ws.index(c)] for c in n)
    y = _from_2d(y2, y_shape, m + n, ys)
    # empty arrays with the inputs' shapes and dtypes: residuals are arrays
    kinds = (jnp.zeros((0,) + x.shape, x.dtype), jnp.zeros((0,) + w.shape, w.dtype))
    return y, (xq, sx, wq, sw, kinds)


def _bw_bwd(spec, opts, res, g):
    xq, sx, wq, sw, (x_kind, w_kind) = res
    x_shape, w_shape = x_kind.shape[1:], w_kind.shape[1:]
    xs, ws, ys, m, k, n = _letters(spec)
    g2, _ = _to_2d(g, ys, m, n)
    dgrad = _local(_dgrad_local, spec, opts, ("mn", "kn", "kn"), ("mk",), x_kind.dtype)
    wgrad = _local(_wgrad_local, spec, opts, ("mk", "mk", "mn"), ("kn",), w_kind.dtype)
    (dx2,) = dgrad(g2, wq, sw)
    (dw2,) = wgrad(xq, sx, g2)
    x_t_shape = tuple(x_shape[xs.index(c)] for c in m + k)
    dx = _from_2d(dx2, x_t_shape, m + k, xs)
    dw = _from_2d(dw2, tuple(w_shape[ws.index(c)] for c in k + n), k + n, ws)
    return dx, dw


blockwise_project.defvjp(_bw_fwd, _bw_bwd)
