"""The Triton-backend kernels of `pallas_kernels.flash_attention` (forward; backward as a dk/dv kernel and a dq
kernel) and the static configuration both backends share. The design (scaled fp16 operands, log2-domain
softmax, packed-document block skipping, GQA) is in `flash_attention`'s module docstring."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .segments import block_spans, cross_block_spans

LOG2E = math.log2(math.e)
_NEG = -1e30            # finite "minus infinity" for masked logits (log2 domain) and the running-max init
MIN_BLOCK = 16          # Triton dots need every dimension >= 16


def _seg_args(seg, block: int, by_keys: bool = False):
    """(query ids, key ids, spans) for the kernels: ``seg`` is one row of ids for both or (query ids, key ids);
    the spans are per query block, or per key block with ``by_keys`` (the dk/dv kernel)."""
    if not isinstance(seg, tuple):
        return [seg, seg, block_spans(seg, block)]
    q_seg, k_seg = seg
    spans = cross_block_spans(k_seg, q_seg, block) if by_keys else cross_block_spans(q_seg, k_seg, block)
    return [q_seg, k_seg, spans]


def visible(q_pos, k_pos, *, causal, sliding_window):
    """Position mask [.., q, k] (bool) or None when every pair is visible."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = None
    if causal:
        mask = diff >= 0
    if sliding_window is not None:
        win = diff < sliding_window if causal else jnp.abs(diff) < sliding_window
        mask = win if mask is None else jnp.logical_and(mask, win)
    return mask


# ----------------------------------------------------------------------------------------------------------------
# Static configuration (hashable, passed as a nondiff argument of the custom_vjp)
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlashConfig:
    backend: str
    causal: bool
    scale: float
    window: int | None
    seq_len: int          # real (unpadded) sequence length; arrays reaching the kernels are padded
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int
    num_stages: int
    num_warps_bwd: int
    num_stages_bwd: int
    interpret: bool
    fuse_dq: bool = False  # mosaic: dq from the dk/dv kernel (TMA reduce-add) instead of a dq kernel


# ----------------------------------------------------------------------------------------------------------------
# Triton-backend kernels
# ----------------------------------------------------------------------------------------------------------------

def _dot(a, b, *, contract, precision):
    """2-D matmul with fp32 accumulation; contract = (a_dim, b_dim)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _tile_mask(q_start, bq, k_start, bk, q_seg, k_seg, cfg: FlashConfig, pad: bool):
    """bool [bq, bk] visibility of a (q tile, kv tile) pair, or None if nothing is ever masked (static)."""
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)
    k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
    mask = visible(q_pos, k_pos, causal=cfg.causal, sliding_window=cfg.window)
    if pad:
        valid = jnp.broadcast_to((k_pos < cfg.seq_len)[None, :], (bq, bk))
        mask = valid if mask is None else jnp.logical_and(mask, valid)
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        mask = same if mask is None else jnp.logical_and(mask, same)
    return mask


def _kv_block_range(q_start, bq, bk, cfg: FlashConfig):
    """[lo, hi) kv block indices that can hold a visible key for queries [q_start, q_start + bq)."""
    if cfg.causal:
        hi_key = jnp.minimum(q_start + bq, cfg.seq_len)
    elif cfg.window is not None:
        hi_key = jnp.minimum(q_start + bq - 1 + cfg.window, cfg.seq_len)
    else:
        hi_key = cfg.seq_len
    hi = lax.div(hi_key + (bk - 1), bk)
    lo = 0
    if cfg.window is not None:
        lo = lax.div(jnp.maximum(q_start - cfg.window + 1, 0), bk)
    return lo, hi


def _narrow(lo, hi, span_ref, block: int):
    """Block range [lo, hi) cut to the blocks overlapping positions [span[0], span[1]) (`segments.block_spans`:
    where the tile's document ids occur), so blocks of other documents are never visited."""
    return (jnp.maximum(lo, lax.div(span_ref[0], block)),
            jnp.minimum(hi, lax.div(span_ref[1] + (block - 1), block)))


def _q_block_range(k_start, bk, bq, cfg: FlashConfig):
    """[lo, hi) q block indices that can see a key in [k_start, k_start + bk); padded query rows are skipped."""
    lo = 0
    if cfg.causal:
        lo = lax.div(k_start, bq)
    elif cfg.window is not None:
        lo = lax.div(jnp.maximum(k_start - cfg.window + 1, 0), bq)
    if cfg.window is not None:
        hi_row = jnp.minimum(k_start + bk - 1 + cfg.window, cfg.seq_len)
    else:
        hi_row = cfg.seq_len
    hi = lax.div(hi_row + (bq - 1), bq)
    return lo, hi


# Measured on an H100 (bf16, Llama-3-8B heads, seq 4096, batch 2; scripts/bench_kernels.py): the split made the
# forward 12% faster (1.13 -> 1.00 ms) but forward+backward 6% slower (3.39 -> 3.61 ms: two pipelined loops per
# backward kernel cost more than the masks they save), so only the forward splits.
SPLIT_BACKWARD = False


def _splits(cfg: FlashConfig, has_seg: bool, backward: bool = False) -> bool:
    """Whether the block loops split into an unmasked and a masked range (static): without segment ids and without
    a sliding window, only the blocks on the causal diagonal and those holding padded keys need a mask."""
    return cfg.window is None and not has_seg and (SPLIT_BACKWARD or not backward)


def _kv_block_split(q_start, bq, bk, cfg: FlashConfig):
    """(lo, mid, hi): kv blocks [lo, mid) are fully visible to queries [q_start, q_start + bq) (no mask needed),
    [mid, hi) need the mask. Only valid when `_splits` (no window, no segment ids).

    Block j (keys [j*bk, (j+1)*bk)) is fully visible iff it holds no padded key, (j+1)*bk <= seq_len, and, if
    causal, its last key is <= the first query: (j+1)*bk - 1 <= q_start, i.e. (j+1)*bk <= q_start (q_start is a
    multiple of bq >= 16 and (j+1)*bk of bk >= 16, so (j+1)*bk != q_start + 1). Those are the blocks j < mid."""
    lo, hi = _kv_block_range(q_start, bq, bk, cfg)
    mid = cfg.seq_len // bk
    if cfg.causal:
        mid = jnp.minimum(lax.div(q_start, bk), mid)
    return lo, jnp.minimum(mid, hi), hi


def _q_block_split(k_start, bk, bq, cfg: FlashConfig, pad: bool):
    """(lo, mid, hi): q blocks [lo, mid) need the mask for keys [k_start, k_start + bk), [mid, hi) see every key
    of the block (no mask needed). Only valid when `_splits` (no window, no segment ids).

    Block i (queries [i*bq, (i+1)*bq)) sees the whole kv block iff the kv block holds no padded key,
    k_start + bk <= seq_len, and, if causal, its first query is >= the last key: i*bq >= k_start + bk - 1, i.e.
    i*bq >= k_start + bk (both multiples of 16), i >= cdiv(k_start + bk, bq). Padded query rows need no mask (their
    cotangent and delta are zero, so they add nothing to dk / dv)."""
    lo, hi = _q_block_range(k_start, bk, bq, cfg)
    mid = lo
    if cfg.causal:
        mid = jnp.clip(lax.div(k_start + bk + (bq - 1), bq), lo, hi)
    if pad:
        mid = jnp.where(k_start + bk > cfg.seq_len, hi, mid)
    return lo, mid, hi


def _fwd_kernel(*refs, cfg: FlashConfig, has_seg: bool, pad: bool, residual: bool):
    refs = list(refs)
    ores_ref = refs.pop() if residual else None
    if has_seg:
        q_ref, k_ref, v_ref, qseg_ref, kseg_ref, span_ref, sc_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, sc_ref, o_ref, lse_ref = refs
        qseg_ref = kseg_ref = span_ref = None
    bq, bk = cfg.block_q, cfg.block_k
    d = q_ref.shape[-1]
    prec = _precision(q_ref.dtype)
    q_start = pl.program_id(0) * bq
    q = q_ref[...]
    q_seg = qseg_ref[...] if has_seg else None
    scale2 = sc_ref[0]                      # softmax_scale * log2(e) * s_q * s_k (undoes the operand scaling)

    def body(j, carry, masked: bool):
        acc, m, l = carry
        k_start = j * bk
        ks = pl.ds(k_start, bk)
        kt = k_ref[ks, :]
        vt = v_ref[ks, :]
        s = _dot(q, kt, contract=(1, 1), precision=prec)                       # [bq, bk] fp32, unscaled
        mask = None
        if masked:
            mask = _tile_mask(q_start, bq, k_start, bk, q_seg, kseg_ref[ks] if has_seg else None, cfg, pad)
        if mask is None:
            # max(s * c) = max(s) * c for c > 0; s * c - m is one FMA per element (FlashAttention's inner loop).
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * scale2)
            p = jnp.exp2(s * scale2 - m_new[:, None])
        else:
            s = jnp.where(mask, s * scale2, _NEG)                               # log2 domain
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)              # fully masked rows stay at 0
        alpha = jnp.exp2(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(vt.dtype), vt, contract=(1, 0), precision=prec)
        return acc, m_new, l

    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    if _splits(cfg, has_seg):
        # Fully visible kv blocks first (no mask), then the diagonal / padded ones: the same order as one loop.
        lo, mid, hi = _kv_block_split(q_start, bq, bk, cfg)
        carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), init)
        acc, m, l = lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)
    else:
        lo, hi = _kv_block_range(q_start, bq, bk, cfg)
        if has_seg:
            lo, hi = _narrow(lo, hi, span_ref, bk)
        acc, m, l = lax.fori_loop(lo, hi, functools.partial(body, masked=True), init)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o = acc / l_safe[:, None]                                                   # in units of s_v
    o_ref[...] = (o * sc_ref[1]).astype(o_ref.dtype)
    if residual:
        ores_ref[...] = o.astype(ores_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe))              # +inf: p = exp2(s - lse) = 0


def triton_fwd(q, k, v, seg, sc, cfg: FlashConfig, *, out_dtype, residual: bool):
    """Padded compute-dtype operands (see `_to_compute`), sc [b, kv_heads, 2] fp32 = (logit multiplier in the
    log2 domain, s_v) -> (out [b, s_pad, h, d] in out_dtype, lse [b, h, s_pad] fp32 (log2 domain)[, o_res]),
    o_res = out / s_v in the compute dtype (only with residual=True; the backward's delta reads it)."""
    b, sp, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    bq = cfg.block_q
    has_seg = seg is not None
    sq = pl.squeezed
    in_specs = [
        pl.BlockSpec((sq, bq, sq, d), lambda i, j, hh: (j, i, hh, 0)),
        pl.BlockSpec((sq, sp, sq, d), lambda i, j, hh: (j, 0, hh // group, 0)),
        pl.BlockSpec((sq, sp, sq, d), lambda i, j, hh: (j, 0, hh // group, 0)),
    ]
    args = [q, k, v]
    if has_seg:
        in_specs += [pl.BlockSpec((sq, bq), lambda i, j, hh: (j, i)),
                     pl.BlockSpec((sq, sp), lambda i, j, hh: (j, 0)),
                     pl.BlockSpec((sq, sq, 2), lambda i, j, hh: (j, i, 0))]
        args += _seg_args(seg, bq)
    in_specs.append(pl.BlockSpec((sq, sq, 2), lambda i, j, hh: (j, hh // group, 0)))
    args.append(sc)
    o_spec = pl.BlockSpec((sq, bq, sq, d), lambda i, j, hh: (j, i, hh, 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((b, h, sp), jnp.float32)]
    out_specs = [o_spec, pl.BlockSpec((sq, sq, bq), lambda i, j, hh: (j, hh, i))]
    if residual:
        out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
        out_specs.append(o_spec)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, has_seg=has_seg, pad=sp != cfg.seq_len, residual=residual),
        out_shape=tuple(out_shape),
        grid=(sp // bq, b, h),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)


def _dkv_kernel(*refs, cfg: FlashConfig, has_seg: bool, pad: bool, group: int):
    if has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, span_ref, sc_ref, dk_ref, dv_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sc_ref, dk_ref, dv_ref = refs
        qseg_ref = kseg_ref = span_ref = None
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    d = k_ref.shape[-1]
    prec = _precision(k_ref.dtype)
    scale2 = sc_ref[0]
    k_start = pl.program_id(0) * bk
    kt = k_ref[...]
    vt = v_ref[...]
    k_seg = kseg_ref[...] if has_seg else None

    def q_body(i, carry, g, masked: bool):
        dk, dv = carry
        q_start = i * bq
        qs = pl.ds(q_start, bq)
        qt = q_ref[qs, g, :]
        dot_ = do_ref[qs, g, :]
        lse = lse_ref[g, qs]
        delta = delta_ref[g, qs]
        s = _dot(qt, kt, contract=(1, 1), precision=prec) * scale2               # [bq, bk]
        p = jnp.exp2(s - lse[:, None])
        if masked:
            mask = _tile_mask(q_start, bq, k_start, bk, qseg_ref[qs] if has_seg else None, k_seg, cfg, pad)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
        dv = dv + _dot(p.astype(dot_.dtype), dot_, contract=(0, 0), precision=prec)
        dp = _dot(dot_, vt, contract=(1, 1), precision=prec)                     # [bq, bk]
        ds = p * (dp - delta[:, None])
        dk = dk + _dot(ds.astype(qt.dtype), qt, contract=(0, 0), precision=prec)
        return dk, dv

    if _splits(cfg, has_seg, backward=True):
        # q blocks on the diagonal or seeing padded keys (masked) first, then those below it: ascending order.
        lo, mid, hi = _q_block_split(k_start, bk, bq, cfg, pad)

        def g_body(g, carry):
            carry = lax.fori_loop(lo, mid, functools.partial(q_body, g=g, masked=True), carry)
            return lax.fori_loop(mid, hi, functools.partial(q_body, g=g, masked=False), carry)
    else:
        lo, hi = _q_block_range(k_start, bk, bq, cfg)
        if has_seg:
            lo, hi = _narrow(lo, hi, span_ref, bq)

        def g_body(g, carry):
            return lax.fori_loop(lo, hi, functools.partial(q_body, g=g, masked=True), carry)

    init = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    if group == 1:
        dk, dv = g_body(0, init)
    else:
        dk, dv = lax.fori_loop(0, group, g_body, init)
    dk_ref[...] = (dk * sc_ref[2]).astype(dk_ref.dtype)
    dv_ref[...] = (dv * sc_ref[3]).astype(dv_ref.dtype)


def _dq_kernel(*refs, cfg: FlashConfig, has_seg: bool, pad: bool):
    if has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, span_ref, sc_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sc_ref, dq_ref = refs
        qseg_ref = kseg_ref = span_ref = None
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    d = q_ref.shape[-1]
    prec = _precision(q_ref.dtype)
    scale2 = sc_ref[0]
    q_start = pl.program_id(0) * bq
    qt = q_ref[...]
    dot_ = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_seg = qseg_ref[...] if has_seg else None

    def body(j, dq, masked: bool):
        k_start = j * bk
        ks = pl.ds(k_start, bk)
        kt = k_ref[ks, :]
        vt = v_ref[ks, :]
        s = _dot(qt, kt, contract=(1, 1), precision=prec) * scale2
        p = jnp.exp2(s - lse[:, None])
        if masked:
            mask = _tile_mask(q_start, bq, k_start, bk, q_seg, kseg_ref[ks] if has_seg else None, cfg, pad)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
        dp = _dot(dot_, vt, contract=(1, 1), precision=prec)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(kt.dtype), kt, contract=(1, 0), precision=prec)

    init = jnp.zeros((bq, d), jnp.float32)
    if _splits(cfg, has_seg, backward=True):
        lo, mid, hi = _kv_block_split(q_start, bq, bk, cfg)
        dq = lax.fori_loop(lo, mid, functools.partial(body, masked=False), init)
        dq = lax.fori_loop(mid, hi, functools.partial(body, masked=True), dq)
    else:
        lo, hi = _kv_block_range(q_start, bq, bk, cfg)
        if has_seg:
            lo, hi = _narrow(lo, hi, span_ref, bk)
        dq = lax.fori_loop(lo, hi, functools.partial(body, masked=True), init)
    dq_ref[...] = (dq * sc_ref[1]).astype(dq_ref.dtype)


def triton_bwd(q, k, v, seg, lse, delta, do, sc, cfg: FlashConfig, *, out_dtype):
    """Padded compute-dtype operands (q, k, v, do; see `_to_compute`), lse [b, h, s_pad] (log2 domain), delta
    [b, h, s_pad] = rowsum(do * out) in the operands' units, sc [b, kv_heads, 4] fp32 = (logit multiplier, dq, dk,
    dv multipliers) -> (dq, dk, dv) in out_dtype."""
    b, sp, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    has_seg = seg is not None
    pad = sp != cfg.seq_len
    sq = pl.squeezed
    params = pltriton.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)

    # dk / dv: grid over (kv blocks, batch, kv heads); q-side blocks cover the `group` query heads of the kv head.
    in_specs = [
        pl.BlockSpec((sq, sp, group, d), lambda i, j, kh: (j, 0, kh, 0)),       # q
        pl.BlockSpec((sq, bk, sq, d), lambda i, j, kh: (j, i, kh, 0)),           # k
        pl.BlockSpec((sq, bk, sq, d), lambda i, j, kh: (j, i, kh, 0)),           # v
        pl.BlockSpec((sq, sp, group, d), lambda i, j, kh: (j, 0, kh, 0)),       # dO
        pl.BlockSpec((sq, group, sp), lambda i, j, kh: (j, kh, 0)),              # lse
        pl.BlockSpec((sq, group, sp), lambda i, j, kh: (j, kh, 0)),              # delta
    ]
    args = [q, k, v, do, lse, delta]
    if has_seg:
        in_specs += [pl.BlockSpec((sq, sp), lambda i, j, kh: (j, 0)),
                     pl.BlockSpec((sq, bk), lambda i, j, kh: (j, i)),
                     pl.BlockSpec((sq, sq, 2), lambda i, j, kh: (j, i, 0))]
        args += _seg_args(seg, bk, by_keys=True)
    in_specs.append(pl.BlockSpec((sq, sq, 4), lambda i, j, kh: (j, kh, 0)))
    args.append(sc)
    kv_spec = pl.BlockSpec((sq, bk, sq, d), lambda i, j, kh: (j, i, kh, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, has_seg=has_seg, pad=pad, group=group),
        out_shape=(jax.ShapeDtypeStruct(k.shape, out_dtype), jax.ShapeDtypeStruct(v.shape, out_dtype)),
        grid=(sp // bk, b, kvh),
        in_specs=in_specs,
        out_specs=(kv_spec, kv_spec),
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dkv",
    )(*args)

    # dq: grid over (q blocks, batch, heads).
    in_specs = [
        pl.BlockSpec((sq, bq, sq, d), lambda i, j, hh: (j, i, hh, 0)),           # q
        pl.BlockSpec((sq, sp, sq, d), lambda i, j, hh: (j, 0, hh // group, 0)),  # k
        pl.BlockSpec((sq, sp, sq, d), lambda i, j, hh: (j, 0, hh // group, 0)),  # v
        pl.BlockSpec((sq, bq, sq, d), lambda i, j, hh: (j, i, hh, 0)),           # dO
        pl.BlockSpec((sq, sq, bq), lambda i, j, hh: (j, hh, i)),                 # lse
        pl.BlockSpec((sq, sq, bq), lambda i, j, hh: (j, hh, i)),                 # delta
    ]
    args = [q, k, v, do, lse, delta]
    if has_seg:
        in_specs += [pl.BlockSpec((sq, bq), lambda i, j, hh: (j, i)),
                     pl.BlockSpec((sq, sp), lambda i, j, hh: (j, 0)),
                     pl.BlockSpec((sq, sq, 2), lambda i, j, hh: (j, i, 0))]
        args += _seg_args(seg, bq)
    in_specs.append(pl.BlockSpec((sq, sq, 4), lambda i, j, hh: (j, hh // group, 0)))
    args.append(sc)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, has_seg=has_seg, pad=pad),
        out_shape=jax.ShapeDtypeStruct(q.shape, out_dtype),
        grid=(sp // bq, b, h),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((sq, bq, sq, d), lambda i, j, hh: (j, i, hh, 0)),
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(*args)
    return dq, dk, dv
