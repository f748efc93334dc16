"""Flash attention (FlashAttention-2 style) as Pallas kernels, with a Pallas backward.

Public API:
  flash_attention(q, k, v, *, causal=True, segment_ids=None, softmax_scale=None, sliding_window=None,
                  block_q=64, block_k=64, block_q_bwd=None, block_k_bwd=None, num_warps=None, num_stages=2,
                  interpret=None, backend="triton") -> out [batch, seq, heads, head_dim]
  flash_attention_reference(q, k, v, *, causal=True, segment_ids=None, softmax_scale=None,
                            sliding_window=None) -> plain jnp, fp32 softmax

Layout and semantics:
  * q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim]; heads % kv_heads == 0 (MHA, GQA, MQA).
    Query head h reads kv head h // (heads // kv_heads); K/V are never repeated in memory (the BlockSpec index_map
    picks the kv head).
  * segment_ids [batch, seq] (integer): a query attends only to keys with the same id (packed documents).
  * causal: key j is visible to query i only if j <= i.
  * sliding_window=W: additionally i - j < W (causal), or |i - j| < W (non-causal). W=1 -> attend to self only.
  * A query row with no visible key outputs 0 (never NaN) and gets zero gradients, in the kernels and in the
    reference. Through this API every real query sees at least itself, so such rows only occur for the padded rows
    of a ragged sequence (e.g. with a sliding window); they are handled all the same.
  * softmax_scale defaults to 1/sqrt(head_dim). Softmax statistics (running max, sum, log-sum-exp) are fp32 and
    every matmul accumulates in fp32. fp32 inputs use IEEE fp32 dots (precision=HIGHEST, no TF32).
  * 16-bit inputs (bf16, fp16) compute on fp16 matmul operands, not bf16 ones: the wrapper divides q, k, v (and
    the backward dO) by a power of two per (batch, kv head) and converts them to fp16, which is exact for bf16
    values (8-bit significand) in fp16's normal range; P and dS are rounded to fp16 (11-bit significand, 8x finer
    than bf16) before their matmuls, and the fp32 epilogues undo the scales. fp16 and bf16 tensor-core matmuls
    have the same throughput (Ampere, Hopper), so this costs only the O(seq * heads * head_dim) scaling passes.
    Scales: |q|, |k| < 2**15 (the logits accumulate in fp32); |v| < 1, so |out / s_v| < 1; |dO| < 2**14 / head_dim,
    so |dP|, |delta| < 2**14 and |dS| < 2**15 fit fp16 (max 65504), and dS keeps full fp16 precision down to
    P ~ 1e-6. Values far below their (batch, kv head)'s maximum (under 2**-29 of it for q and k, 2**-14 for v,
    2**-19 to 2**-21 for dO) fall into fp16's subnormals, where the absolute error stays below 2**-24 of that
    maximum. Against the reference rounded once to bf16, plain FA2 (P and dS in bf16) is off by 2-3e-3 for the
    output and the gradients; this by about 1e-3 (see the tests).
  * delta = rowsum(dO * O) must see O more precisely than the bf16 output, so for 16-bit inputs the forward
    under autodiff also writes O / s_v in fp16 as the residual (one extra [batch, seq, heads, head_dim] 16-bit
    array); a forward without autodiff writes only the output.

Design (Triton backend, `_triton_*`):
  * Ragged seq: the wrapper pads seq to a multiple of max(block sizes) and slices the output; padded keys are masked
    in-kernel by position (`kv_pos < seq_len`, seq_len static), padded query rows are computed and thrown away (their
    cotangent is zero, so they add nothing to dk/dv).
  * Forward: grid (q_blocks, batch, heads); each program keeps its [block_q, head_dim] q tile and loops over kv
    blocks with an online softmax in the log2 domain (exp2). The kv loop is bounded to the blocks that can be
    visible: [window start, diagonal] for causal (fully masked blocks above the diagonal and left of the window are
    skipped) and never past the last real (unpadded) key. Saves lse = m + log2(l) (log2 domain) [batch, heads, seq].
  * Unmasked blocks: without segment ids and without a sliding window (plain causal or full attention), the block
    loops split in two `fori_loop`s (`_kv_block_split`, `_q_block_split`): the blocks that
    are fully visible (strictly below the causal diagonal, no padded key) run without building the mask (no iota /
    compare / select), and only the diagonal and padded blocks build it. The order of the blocks is unchanged. The
    forward's unmasked loop also folds the logit scale into the exponent (exp2(s * c - m), one FMA per element).
    Segment ids and windows mask every block. The backward kernels can split the same way but do not by default
    (`SPLIT_BACKWARD`: slower on an H100).
  * Packed documents: with segment ids every block loop is also narrowed to the blocks where the tile's ids occur
    (`segments.block_spans`: from the first to the last occurrence of each id, [b, blocks, 2], computed in jnp), so
    a tile of one document skips the other documents' blocks instead of visiting them fully masked: with n
    equal documents per row, causal attention does about 1/n of the block pairs.
  * Backward: delta = rowsum(dO * O) in jnp (fp32, on the scaled operands), then two kernels:
      - dk/dv: grid (kv_blocks, batch, kv_heads); each program owns one kv tile and loops over the query heads of
        its GQA group (q / dO / lse / delta blocks cover the group's heads) and over the visible q blocks, so the
        group sum happens in registers and dk/dv are written once, in the input dtype.
      - dq: grid (q_blocks, batch, heads); loop over visible kv blocks (same bounds as the forward).
  * `backend` dispatches through _IMPLS (forward, backward). backend="mosaic" runs the Mosaic GPU kernels of
    `flash_attention_mosaic` (forward) and `flash_attention_mosaic_bwd` (dk/dv with dq fused in by TMA
    reduce-add, or dq and dk/dv kernels with fuse_dq=False) for Hopper: TMA, wgmma,
    warp specialization; causal or full attention, segment ids, 16-bit inputs, head_dim 64 or 128.
  * On CPU the kernels run in Pallas interpret mode (interpret=None selects it automatically).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ._common import cdiv, check_backend, is_pow2, next_pow2, resolve_interpret
from .flash_attention_triton import LOG2E, MIN_BLOCK, FlashConfig, triton_bwd, triton_fwd, visible

__all__ = ["flash_attention", "flash_attention_reference", "head_dim_supported"]

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def head_dim_supported(d: int) -> bool:
    """Whether the Triton kernel takes this head_dim: a power of two >= 16 (64, 128 and 256 are the usual)."""
    return d >= MIN_BLOCK and is_pow2(d)


# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------

def flash_attention_reference(q, k, v, *, causal: bool = True, segment_ids=None, softmax_scale=None,
                              sliding_window=None):
    """Plain jnp attention with the same semantics as `flash_attention` (fp32 math, output in q.dtype).

    GQA is done by reshaping q to [b, s, kv_heads, group, d] (K/V are not repeated). Rows with no visible key give 0.
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    scale = (1.0 / math.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    hp = lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(b, s, kvh, g, d)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qf, kf, precision=hp) * scale          # [b, kv, g, q, s]
    pos = jnp.arange(s)
    mask = visible(pos, pos, causal=causal, sliding_window=sliding_window)          # [q, s] or None
    mask = jnp.ones((s, s), bool) if mask is None else mask
    mask = jnp.broadcast_to(mask, (b, s, s))
    if segment_ids is not None:
        mask = jnp.logical_and(mask, segment_ids[:, :, None] == segment_ids[:, None, :])
    mask = mask[:, None, None]                                                        # [b, 1, 1, q, s]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, vf, precision=hp)
    return out.reshape(b, s, h, d).astype(q.dtype)


def _mosaic_fwd(q, k, v, seg, sc, cfg: FlashConfig, *, out_dtype, residual: bool):
    """The Mosaic GPU forward (`flash_attention_mosaic`), same operands and results as `triton_fwd`."""
    from .flash_attention_mosaic import mosaic_forward  # Mosaic GPU only when its backend is asked for

    assert cfg.window is None                     # refused in flash_attention()
    return mosaic_forward(q, k, v, sc, seg, causal=cfg.causal, seq_len=cfg.seq_len, block_q=cfg.block_q,
                          block_kv=cfg.block_k, max_steps=cfg.num_stages, out_dtype=out_dtype, residual=residual,
                          interpret=cfg.interpret)


def _mosaic_bwd(q, k, v, seg, lse, delta, do, sc, cfg: FlashConfig, *, out_dtype):
    """The Mosaic GPU backward (`flash_attention_mosaic_bwd`), same operands and results as `triton_bwd`."""
    from .flash_attention_mosaic_bwd import mosaic_backward

    assert cfg.window is None
    return mosaic_backward(q, k, v, lse, delta, do, sc, seg, causal=cfg.causal, seq_len=cfg.seq_len,
                           block_q=cfg.block_q_bwd, block_kv=cfg.block_k_bwd, slots=cfg.num_stages_bwd,
                           out_dtype=out_dtype, interpret=cfg.interpret, fuse_dq=cfg.fuse_dq)


# backend -> (forward, backward); both backends' kernels share the residuals (log2-domain log-sum-exp, O / s_v).
_IMPLS = {"triton": (triton_fwd, triton_bwd), "mosaic": (_mosaic_fwd, _mosaic_bwd)}


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp (on padded arrays) and the public function
# ----------------------------------------------------------------------------------------------------------------

def _compute_dtype(dtype):
    """fp32 inputs compute in fp32; 16-bit inputs in fp16 on scaled operands (see the module docstring)."""
    return jnp.float32 if dtype == jnp.float32 else jnp.float16


def _pow2_scale(x, group: int, max_exp: int):
    """Per-(batch, kv head) power of two s such that |x / s| < 2**max_exp, fp32 [b, kv_heads].

    x [b, s, heads, d] with heads = kv_heads * group. A power of two keeps x / s exact; amax 0 gives 2**-max_exp.
    """
    b, sp, h, d = x.shape
    amax = jnp.max(jnp.abs(x.reshape(b, sp, h // group, group, d)), axis=(1, 3, 4)).astype(jnp.float32)
    _, e = jnp.frexp(amax)                                  # amax < 2**e
    return jnp.ldexp(jnp.ones_like(amax), e - max_exp)


def _to_compute(x, scale, group: int, dtype):
    """x / scale (per batch, kv head), in the compute dtype; exact for bf16 values in fp16's normal range."""
    if dtype == jnp.float32:
        return x
    b, sp, h, d = x.shape
    xs = x.astype(jnp.float32).reshape(b, sp, h // group, group, d) / scale[:, None, :, None, None]
    return xs.reshape(x.shape).astype(dtype)


def _fwd_operands(q, k, v, cfg: FlashConfig):
    """(q, k, v) in the compute dtype, forward scalars [b, kv, 2], operand scales (s_q, s_k, s_v)."""
    b, kvh = k.shape[0], k.shape[2]
    group = q.shape[2] // kvh
    cdt = _compute_dtype(q.dtype)
    if cdt == jnp.float32:
        ones = jnp.ones((b, kvh), jnp.float32)
        scales = (ones, ones, ones)
    else:
        # |q|, |k| < 2**15 (fp16's top binade; q . k accumulates in fp32), so that fp16 represents them fully down
        # to 2**-29 of their maximum. |v| < 1, so |out / s_v| < 1 and the backward's dP = dO . v stays bounded.
        scales = (_pow2_scale(q, group, 15), _pow2_scale(k, 1, 15), _pow2_scale(v, 1, 0))
    s_q, s_k, s_v = scales
    ops = (_to_compute(q, s_q, group, cdt), _to_compute(k, s_k, 1, cdt), _to_compute(v, s_v, 1, cdt))
    sc = jnp.stack([s_q * s_k * jnp.float32(cfg.scale * LOG2E), s_v], axis=-1)
    return ops, sc, scales


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, cfg: FlashConfig):
    ops, sc, _ = _fwd_operands(q, k, v, cfg)
    return _IMPLS[cfg.backend][0](*ops, seg, sc, cfg, out_dtype=q.dtype, residual=False)[0]


def flash_fwd(q, k, v, seg, cfg: FlashConfig):
    ops, sc, scales = _fwd_operands(q, k, v, cfg)
    residual = ops[0].dtype != jnp.float32
    res = _IMPLS[cfg.backend][0](*ops, seg, sc, cfg, out_dtype=q.dtype, residual=residual)
    out, lse = res[:2]
    o_res = res[2] if residual else out                     # out / s_v (s_v = 1 in fp32)
    return out, (*ops, seg, o_res, lse, sc[..., 0], scales)


def flash_bwd(cfg: FlashConfig, res, do, dlse=None):
    """dlse: the cotangent of the log2-domain lse (`flash_attention_lse`), or None."""
    q, k, v, seg, o_res, lse, c_logit, (s_q, s_k, s_v) = res
    group = q.shape[2] // k.shape[2]
    cdt = q.dtype
    if cdt == jnp.float32:
        s_do = jnp.ones_like(s_q)
    else:
        # The barrier keeps XLA from constant-folding the amax when do is a constant (jax.grad of out.sum()):
        # folding a reduce over a [batch, seq, heads, head_dim] broadcast in XLA's evaluator takes minutes.
        do = lax.optimization_barrier(do)
        # |do / s_do| < 2**14 / head_dim: |dp|, |delta| < 2**14 and |dS| < 2**15 stay inside fp16's range, and
        # dS rarely drops below its normal range (2**-14).
        s_do = _pow2_scale(do, group, 14 - (q.shape[-1].bit_length() - 1))
    do_c = _to_compute(do, s_do, group, cdt)
    delta = jnp.einsum("bshd,bshd->bhs", o_res.astype(jnp.float32), do_c.astype(jnp.float32))  # [b, h, sp]
    if dlse is not None:
        # d lse2_i / d logit_ij = log2(e) p_ij, so lse's cotangent enters as dS = P * (dP - (delta - dlse2 log2(e)))
        # with dlse2 in dS's units (s_do * s_v)
        unit = jnp.repeat(s_do * s_v, group, axis=1)[:, :, None]
        delta = delta - dlse * jnp.float32(LOG2E) / unit
    ds_unit = s_do * s_v * jnp.float32(cfg.scale)           # dS = P * (dP - delta) comes in units of s_do * s_v
    sc = jnp.stack([c_logit, ds_unit * s_k, ds_unit * s_q, s_do], axis=-1)
    out_dtype = do.dtype
    dq, dk, dv = _IMPLS[cfg.backend][1](q, k, v, seg, lse, delta, do_c, sc, cfg, out_dtype=out_dtype)
    return dq, dk, dv, jax.tree.map(lambda _: None, seg)


_flash.defvjp(flash_fwd, flash_bwd)


def _check_block(value, name):
    if not isinstance(value, int) or isinstance(value, bool) or value < MIN_BLOCK or not is_pow2(value):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")


def _validate(q, k, v, segment_ids, softmax_scale, sliding_window, blocks):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    b, s, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    kb, ks, kvh, kd = k.shape
    if kb != b:
        raise ValueError(f"k/v batch ({kb}) must match q batch ({b})")
    if ks != s:
        raise ValueError(f"k/v seq ({ks}) must match q seq ({s}); cross-attention lengths are not supported")
    if kd != d:
        raise ValueError(f"k/v head_dim ({kd}) must match q head_dim ({d})")
    if kvh <= 0 or h % kvh:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({kvh})")
    if b <= 0 or s <= 0:
        raise ValueError(f"batch and seq must be positive, got q shape {q.shape}")
    if not head_dim_supported(d):
        raise ValueError(f"head_dim must be a power of two >= {MIN_BLOCK} (e.g. 64, 128, 256), got {d}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of float32/bfloat16/float16, got {q.dtype}")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (b, s):
            raise ValueError(f"segment_ids must be [batch, seq] = {(b, s)}, got {tuple(segment_ids.shape)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or isinstance(sliding_window, bool)
                                       or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    for name, value in blocks.items():
        if value is not None:
            _check_block(value, name)


# Forward launch defaults per backend: (block_q, block_k, num_stages). Triton: scripts/bench_kernels.py --sweep on
# an H100 (Llama-3-8B shapes, seq 4096). Mosaic: block_q rows per compute warpgroup (two per CTA), 128-key
# blocks double-buffered (FlashAttention-3's head_dim-128 tile; three stages exceed shared memory there).
_FWD_DEFAULTS = {"triton": (64, 64, 3), "mosaic": (64, 128, 2)}
INTERPRET_DQ_BYTES = 1 << 30    # interpret mode's fused-dq partial sums beyond this are refused (CPU memory)


def interpret_dq_bytes(batch: int, seq: int, heads: int, head_dim: int, block_k_bwd: int = 64) -> int:
    """Memory of backend='mosaic''s fused dq in interpret mode: one fp32 partial sum per key warpgroup
    (`flash_attention_mosaic_bwd`); seq padded as flash_attention pads it."""
    return (seq // block_k_bwd) * batch * seq * heads * head_dim * 4


def prepare(q, k, v, *, causal, segment_ids, kv_segment_ids, softmax_scale, sliding_window, block_q, block_k,
             block_q_bwd, block_k_bwd, num_warps, num_stages, num_warps_bwd, num_stages_bwd, interpret, backend,
             fuse_dq):
    """Validated, padded operands and the static config: (q, k, v, seg, cfg); seg is None, the ids, or (query
    ids, key ids)."""
    check_backend(backend, _IMPLS, "flash_attention")
    if fuse_dq is not None and (backend != "mosaic" or not isinstance(fuse_dq, bool)):
        raise ValueError(f"fuse_dq is a bool option of backend='mosaic' (None there means True), got "
                         f"fuse_dq={fuse_dq!r} with backend={backend!r}")
    if kv_segment_ids is not None and (backend != "triton" or segment_ids is None):
        raise ValueError("kv_segment_ids (keys' own segment ids) needs segment_ids and backend='triton'")
    for ids in (segment_ids, kv_segment_ids):
        _validate(q, k, v, ids, softmax_scale, sliding_window,
                  {"block_q": block_q, "block_k": block_k, "block_q_bwd": block_q_bwd, "block_k_bwd": block_k_bwd})
    if num_stages is not None and (not isinstance(num_stages, int) or isinstance(num_stages, bool)
                                   or num_stages < 1):
        raise ValueError(f"num_stages must be a positive int or None, got {num_stages!r}")
    b, s, h, d = q.shape
    dq_, dk_, dst = _FWD_DEFAULTS[backend]
    block_q = dq_ if block_q is None else block_q
    block_k = dk_ if block_k is None else block_k
    num_stages = dst if num_stages is None else num_stages
    interpret = resolve_interpret(interpret)
    cap = max(MIN_BLOCK, next_pow2(s))
    bqb = min(block_q_bwd or block_q, cap)
    bkb = min(block_k_bwd or block_k, cap)
    stages_bwd = num_stages_bwd if num_stages_bwd is not None else 2
    if backend == "mosaic":
        bqb, bkb = block_q_bwd or 64, block_k_bwd or 64          # not clamped either
        from .flash_attention_mosaic import check_mosaic

        check_mosaic(head_dim=d, dtype=q.dtype, segment_ids=segment_ids, sliding_window=sliding_window,
                     block_q=block_q, block_kv=block_k, max_steps=num_stages, interpret=interpret,
                     block_q_bwd=bqb, block_kv_bwd=bkb, slots_bwd=stages_bwd, fuse_dq=fuse_dq is not False)
        bq, bk = block_q, block_k                   # not clamped: a CTA covers 2 * block_q rows
        multiple = max(2 * bq, bk, 2 * bqb, 2 * bkb)
    else:
        bq, bk = min(block_q, cap), min(block_k, cap)
        multiple = max(bq, bk, bqb, bkb)
    sp = cdiv(s, multiple) * multiple
    if backend == "mosaic" and interpret and fuse_dq is not False:
        partial = interpret_dq_bytes(b, sp, h, d, bkb)
        if partial > INTERPRET_DQ_BYTES:
            raise ValueError(f"flash_attention(backend='mosaic', interpret=True): the fused dq needs "
                             f"{partial / 2**30:.1f} GiB of partial sums at seq {s} (Mosaic GPU's interpreter has "
                             f"no reduce-add); pass "
                             f"fuse_dq=False (model.deterministic_attention=true) or a shorter sequence")
    warps = num_warps if num_warps is not None else 4
    cfg = FlashConfig(
        backend=backend, causal=bool(causal),
        scale=(1.0 / math.sqrt(d)) if softmax_scale is None else float(softmax_scale),
        window=sliding_window, seq_len=s, block_q=bq, block_k=bk, block_q_bwd=bqb, block_k_bwd=bkb,
        num_warps=warps, num_stages=num_stages,
        num_warps_bwd=num_warps_bwd if num_warps_bwd is not None else warps,
        num_stages_bwd=stages_bwd,
        interpret=interpret,
        fuse_dq=backend == "mosaic" and fuse_dq is not False,
    )
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    if kv_segment_ids is not None:
        seg = (seg, kv_segment_ids.astype(jnp.int32))       # queries' and keys' ids (`segments.block_spans`)
    if sp != s:
        padw = ((0, 0), (0, sp - s), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, padw) for x in (q, k, v))
        seg = jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, sp - s))), seg)
    return q, k, v, seg, cfg


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, softmax_scale=None, sliding_window=None,
                    block_q: int | None = None, block_k: int | None = None, block_q_bwd: int | None = None,
                    block_k_bwd: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    num_warps_bwd: int | None = None, num_stages_bwd: int | None = None,
                    interpret: bool | None = None, backend: str = "triton", fuse_dq: bool | None = None):
    """Fused attention; q [b, s, h, d], k/v [b, s, kv_h, d] -> [b, s, h, d] in q.dtype. Differentiable in q, k, v.

    backend: "triton" (every feature, any dtype) or "mosaic" (Mosaic GPU kernels for Hopper, forward and
    backward; segment_ids but no sliding_window, bf16 or fp16, head_dim 64 or 128: anything else raises
    ValueError).
    Block sizes are powers of two >= 16; None -> 64 / 64 (triton) or 64 / 128 (mosaic, multiples of 64; its
    block_q is per compute warpgroup, two per CTA). Triton blocks are clamped down to the padded seq length.
    block_*_bwd default to the forward ones (triton) or 64 (mosaic: multiples of 64; the dq kernel's CTA covers
    2 * block_q_bwd rows, the dk/dv kernel's 2 * block_k_bwd keys). num_stages: Triton pipelining stages, or the
    Mosaic forward's K/V shared-memory slots; None -> 3 (triton) or 2 (mosaic). num_warps=None -> 4.
    num_warps_bwd / num_stages_bwd: the Triton backward's launch settings (default num_warps / 2); for mosaic
    num_stages_bwd is the backward kernels' shared-memory slots (default 2).
    fuse_dq (mosaic only; None -> True): dq is computed in the dk/dv kernel and added into an fp32 accumulator
    by TMA reduce-add (FlashAttention-3's backward: 5 matmuls per block pair, not 7; dq's summation order is then
    not deterministic); False runs a separate dq kernel (deterministic).
    interpret=None -> interpret mode on the CPU backend (Mosaic GPU's interpreter needs jax >= 0.11).
    See the module docstring for masking semantics.
    """
    q, k, v, seg, cfg = prepare(
        q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=None, softmax_scale=softmax_scale,
        sliding_window=sliding_window, block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd,
        block_k_bwd=block_k_bwd, num_warps=num_warps, num_stages=num_stages, num_warps_bwd=num_warps_bwd,
        num_stages_bwd=num_stages_bwd, interpret=interpret, backend=backend, fuse_dq=fuse_dq)
    out = _flash(q, k, v, seg, cfg)
    return out[:, :cfg.seq_len]
