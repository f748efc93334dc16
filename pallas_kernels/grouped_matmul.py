"""Grouped matmul (grouped GEMM) for dropless Mixture-of-Experts, as Pallas Triton kernels with a Pallas backward.

Public API:
  gmm(lhs [M, K], rhs [G, K, N], group_sizes [G] int32, *, preferred_element_type=None, tiling=(128, 64, 128),
      num_warps=4, num_stages=None, interpret=None) -> [M, N]
  gmm_reference(lhs, rhs, group_sizes, preferred_element_type=None) -> jax.lax.ragged_dot (the reference)

Semantics (those of ``jax.lax.ragged_dot``): the rows of lhs are sorted by group; group g is the next
group_sizes[g] rows, multiplied by rhs[g]. Rows past sum(group_sizes) come out as zeros; a sum over M is cut
at M. lhs and rhs share a dtype (bf16, fp16 or fp32); the output has preferred_element_type (default: the
inputs' dtype). Every matmul accumulates in fp32; fp32 inputs use IEEE fp32 dots (no TF32).

Design:
  * Forward (``_gmm_call``): M is cut into row tiles of tm. A tile that straddles a group boundary is visited
    once per group, so the work is a list of (group, row tile) items computed in jnp from group_sizes
    (``schedule``): at most num_tiles + G - 1 items, a static length, so the grid is static. Each item loads
    its tile's rows with a row mask (rows of other groups load as zeros), runs the K loop against rhs[group]
    and stores with a mask on the rows it owns. Two items of one tile own disjoint rows, so the programs never
    race on a store. Tiles wholly past sum(group_sizes) get items that store zeros; the last group's items also
    own the rows past the sum in its last tile; empty groups get no items; the items left over at the end do
    nothing. The grid is (items, N / tn).
  * Backward (``custom_vjp``): d_lhs = gmm(dout, rhs[g]^T) is the forward kernel reading rhs transposed in
    place (no [G, N, K] copy); d_rhs[g] = lhs_g^T @ dout_g (``_tgmm_call``, the transposed grouped matmul)
    runs a grid (G, K / tk, N / tn): each program loops over the row tiles of its group with row-masked loads,
    so an empty group writes zeros. The cotangent is cast to the inputs' dtype as it is loaded.
  * Ragged shapes: M, K and N are zero-padded to multiples of the tiles inside the wrapper and the result
    sliced back. Tiles are powers of two >= 16 (Triton's dot), clamped to the padded problem size.
  * On CPU the kernels run in Pallas interpret mode (interpret=None selects it automatically).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._common import cdiv, is_pow2, next_pow2, resolve_interpret

__all__ = ["gmm", "gmm_reference", "schedule"]

_MIN_TILE = 16          # Triton dots need every dimension >= 16
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_META = 8               # int32 fields per work item (6 used; a power of two for Triton)


def gmm_reference(lhs, rhs, group_sizes, preferred_element_type=None):
    """The reference: ``jax.lax.ragged_dot`` (exact on CPU; XLA:GPU runs it as a masked dense matmul)."""
    return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


@dataclasses.dataclass(frozen=True)
class _Config:
    tm: int
    tk: int
    tn: int
    num_warps: int
    num_stages: int
    interpret: bool
    out_dtype: str


# ----------------------------------------------------------------------------------------------------------------
# The work list
# ----------------------------------------------------------------------------------------------------------------

def group_bounds(group_sizes, m: int):
    """(starts, ends) [G] int32 row ranges of the groups, cut at m (as ragged_dot cuts them)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def schedule(group_sizes, m: int, tm: int, num_tiles: int):
    """The forward's work items, int32 [num_tiles + G - 1, 8]: (group, row tile, valid_lo, valid_hi, own_lo,
    own_hi, 0, 0). Rows [valid_lo, valid_hi) of the tile are the group's (loaded); rows [own_lo, own_hi) are
    stored by this item. Items past the real ones have empty ranges.

    Counting: the non-empty groups cover [0, total) in order, so they touch the first cdiv(total, tm) tiles
    once each plus once more per boundary between two non-empty groups inside a tile (at most G - 1); the
    tiles wholly past total get one zero-storing item each."""
    g_count = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, m)
    total = ends[-1]
    first = starts // tm
    count = jnp.where(ends > starts, (ends - 1) // tm - first + 1, 0)
    tail_first = (total + tm - 1) // tm                         # the zero-storing pseudo group G
    counts = jnp.concatenate([count, (num_tiles - tail_first)[None]])
    firsts = jnp.concatenate([first, tail_first[None]])
    cum = jnp.cumsum(counts)
    w = jnp.arange(num_tiles + g_count - 1, dtype=jnp.int32)
    g = jnp.sum(w[:, None] >= cum[None, :], axis=1).astype(jnp.int32)   # G + 1: past the real items
    real = g <= g_count
    gi = jnp.minimum(g, g_count)
    tile = jnp.where(real, firsts[gi] + w - (cum[gi] - counts[gi]), 0)
    tail = gi == g_count
    gc = jnp.minimum(gi, g_count - 1)
    lo, hi = tile * tm, (tile + 1) * tm
    v_lo = jnp.where(tail, 0, jnp.maximum(starts[gc], lo))
    v_hi = jnp.where(tail, 0, jnp.minimum(ends[gc], hi))
    own_lo = jnp.where(tail, lo, v_lo)
    own_hi = jnp.where(tail | (ends[gc] == total), hi, v_hi)     # the last group also owns the rows past total
    fields = [gc, tile, v_lo, v_hi, own_lo, own_hi]
    fields = [jnp.where(real, f, 0) for f in fields] + [jnp.zeros_like(w)] * (_META - len(fields))
    return jnp.stack(fields, axis=1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

def _dot(a, b, contract):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _rows_in(rows, lo, hi, cols: int):
    return jnp.broadcast_to(((rows >= lo) & (rows < hi))[:, None], (rows.shape[0], cols))


def _gmm_kernel(meta_ref, lhs_ref, rhs_ref, out_ref, *, tm, tk, tn, k_steps, transpose_rhs):
    g, tile, v_lo, v_hi, own_lo, own_hi = (meta_ref[i] for i in range(6))
    row0 = tile * tm
    rows = row0 + jnp.arange(tm, dtype=jnp.int32)
    m_sl, n_sl = pl.ds(row0, tm), pl.ds(pl.program_id(1) * tn, tn)
    valid = _rows_in(rows, v_lo, v_hi, tk)

    def body(kk, acc):
        k_sl = pl.ds(kk * tk, tk)
        b = rhs_ref[g, n_sl, k_sl] if transpose_rhs else rhs_ref[g, k_sl, n_sl]
        a = pltriton.load(lhs_ref.at[m_sl, k_sl], mask=valid, other=0).astype(b.dtype)
        return acc + _dot(a, b, (1, 1) if transpose_rhs else (1, 0))

    # Zero-storing and left-over items skip the loop. (A jnp.where of two constants lowers to an i1 bound,
    # which Triton's scf.for rejects.)
    steps = (v_hi > v_lo).astype(jnp.int32) * k_steps
    acc = lax.fori_loop(0, steps, body, jnp.zeros((tm, tn), jnp.float32))
    pltriton.store(out_ref.at[m_sl, n_sl], acc.astype(out_ref.dtype), mask=_rows_in(rows, own_lo, own_hi, tn))


def _tgmm_kernel(bounds_ref, lhs_ref, dout_ref, out_ref, *, tm, tk, tn):
    start, end = bounds_ref[0], bounds_ref[1]
    k_sl, n_sl = pl.ds(pl.program_id(1) * tk, tk), pl.ds(pl.program_id(2) * tn, tn)

    def body(t, acc):
        rows = t * tm + jnp.arange(tm, dtype=jnp.int32)
        m_sl = pl.ds(t * tm, tm)
        # Both operands masked: rows of other groups may hold anything, and 0 * inf would leak a NaN in.
        a = pltriton.load(lhs_ref.at[m_sl, k_sl], mask=_rows_in(rows, start, end, tk), other=0)
        d = pltriton.load(dout_ref.at[m_sl, n_sl], mask=_rows_in(rows, start, end, tn), other=0).astype(a.dtype)
        return acc + _dot(a, d, (0, 0))

    first = start // tm
    last = jnp.where(end > start, (end + tm - 1) // tm, first)
    acc = lax.fori_loop(first, last, body, jnp.zeros((tk, tn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# pallas_calls (padding in, slicing out)
# ----------------------------------------------------------------------------------------------------------------

def _pad_to(x, shape):
    if x.shape == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - d) for s, d in zip(shape, x.shape)])


def _gmm_call(lhs, rhs, group_sizes, cfg: _Config, *, transpose_rhs: bool, out_dtype):
    """lhs [M, K] @ rhs[g] per group -> [M, N]; rhs is [G, K, N], or [G, N, K] read transposed."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = cfg.tm, cfg.tk, cfg.tn
    mp, kp, np_ = cdiv(m, tm) * tm, cdiv(k, tk) * tk, cdiv(n, tn) * tn
    g_count = rhs.shape[0]
    lhs = _pad_to(lhs, (mp, kp))
    rhs = _pad_to(rhs, (g_count, np_, kp) if transpose_rhs else (g_count, kp, np_))
    meta = schedule(group_sizes, m, tm, mp // tm)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, k_steps=kp // tk, transpose_rhs=transpose_rhs),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(meta.shape[0], np_ // tn),
        in_specs=[pl.BlockSpec((pl.squeezed, _META), lambda w, j: (w, 0)),
                  pl.BlockSpec((mp, kp), lambda w, j: (0, 0)),
                  pl.BlockSpec(rhs.shape, lambda w, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((mp, np_), lambda w, j: (0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="gmm_t" if transpose_rhs else "gmm",
    )(meta, lhs, rhs)
    return out[:m, :n] if (mp, np_) != (m, n) else out


def _tgmm_call(lhs, dout, group_sizes, cfg: _Config, *, out_dtype):
    """d_rhs [G, K, N]: lhs_g^T @ dout_g per group (zeros for an empty group)."""
    m, k = lhs.shape
    n = dout.shape[1]
    tm, tk, tn = cfg.tm, cfg.tk, cfg.tn
    mp, kp, np_ = cdiv(m, tm) * tm, cdiv(k, tk) * tk, cdiv(n, tn) * tn
    g_count = group_sizes.shape[0]
    bounds = jnp.stack(group_bounds(group_sizes, m), axis=1)   # [G, 2]
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn),
        out_shape=jax.ShapeDtypeStruct((g_count, kp, np_), out_dtype),
        grid=(g_count, kp // tk, np_ // tn),
        in_specs=[pl.BlockSpec((pl.squeezed, 2), lambda g, i, j: (g, 0)),
                  pl.BlockSpec((mp, kp), lambda g, i, j: (0, 0)),
                  pl.BlockSpec((mp, np_), lambda g, i, j: (0, 0))],
        out_specs=pl.BlockSpec((pl.squeezed, tk, tn), lambda g, i, j: (g, i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="tgmm",
    )(bounds, _pad_to(lhs, (mp, kp)), _pad_to(dout, (mp, np_)))
    return out[:, :k, :n] if (kp, np_) != (k, n) else out


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp and the public function
# ----------------------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, cfg: _Config):
    return _gmm_call(lhs, rhs, group_sizes, cfg, transpose_rhs=False, out_dtype=jnp.dtype(cfg.out_dtype))


def _gmm_fwd(lhs, rhs, group_sizes, cfg: _Config):
    return _gmm(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg: _Config, res, dout):
    lhs, rhs, group_sizes = res
    # d_lhs contracts over N and produces K: the forward's tiles with tk and tn swapped.
    t_cfg = dataclasses.replace(cfg, tk=cfg.tn, tn=cfg.tk)
    d_lhs = _gmm_call(dout, rhs, group_sizes, t_cfg, transpose_rhs=True, out_dtype=lhs.dtype)
    d_rhs = _tgmm_call(lhs, dout, group_sizes, cfg, out_dtype=rhs.dtype)
    return d_lhs, d_rhs, np.zeros(group_sizes.shape, jax.dtypes.float0)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _tile(requested, size: int, name: str) -> int:
    if not isinstance(requested, int) or requested < _MIN_TILE or not is_pow2(requested):
        raise ValueError(f"tiling: {name} must be a power of two >= {_MIN_TILE}, got {requested!r}")
    return max(_MIN_TILE, min(requested, next_pow2(size)))


def _validate(lhs, rhs, group_sizes):
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"gmm needs lhs [M, K] and rhs [G, K, N], got lhs{lhs.shape} and rhs{rhs.shape}")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"lhs{lhs.shape} and rhs{rhs.shape} disagree on K")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer [G] = [{rhs.shape[0]}], got {group_sizes.dtype}"
                         f"{group_sizes.shape}")
    if lhs.dtype != rhs.dtype or lhs.dtype not in _DTYPES:
        raise ValueError(f"lhs and rhs must share a dtype among float32/bfloat16/float16, got {lhs.dtype} and "
                         f"{rhs.dtype}")
    if 0 in lhs.shape or 0 in rhs.shape:
        raise ValueError(f"gmm needs non-empty operands, got lhs{lhs.shape} and rhs{rhs.shape}")


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None,
        tiling: tuple[int, int, int] = (128, 64, 128), num_warps: int = 4, num_stages: int | None = None,
        interpret: bool | None = None) -> jax.Array:
    """Grouped matmul: out[rows of group g] = lhs[rows of group g] @ rhs[g]; rows past sum(group_sizes) are 0.

    lhs [M, K], rhs [G, K, N], group_sizes [G] (integer); ``tiling`` = (tm, tk, tn), powers of two >= 16,
    clamped to the problem. ``num_stages`` defaults to 3 for 16-bit inputs and 2 for fp32 (shared memory).
    Differentiable in lhs and rhs (Pallas backward kernels). interpret=None: interpret on the CPU backend."""
    _validate(lhs, rhs, group_sizes)
    (m, k), n = lhs.shape, rhs.shape[2]
    tm, tk, tn = (_tile(t, size, name) for t, size, name in zip(tiling, (m, k, n), ("tm", "tk", "tn")))
    if num_stages is None:
        num_stages = 2 if lhs.dtype == jnp.float32 else 3
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype).name
    cfg = _Config(tm, tk, tn, num_warps, num_stages, resolve_interpret(interpret), out_dtype)
    return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), cfg)
