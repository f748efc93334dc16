"""Flash attention Pallas kernel: interpret-mode forward + gradients vs the jnp reference, and cuda lowering.

Accuracy criterion (the same for the RoPE and SwiGLU kernels, tests/test_kernels_rope_swiglu.py):

* The kernel and its jnp reference run on the SAME inputs (fresh random draws in the input dtype) and get the
  SAME cotangent, drawn in the output dtype. The reference computes internally in fp32 (no intermediate 16-bit
  casts) and returns the input dtype, so its output and its gradients are the exact result rounded once to the
  input dtype.
* Error = ||kernel - reference|| / ||reference||, Frobenius norm in float64, for the output and every gradient.
* Bound (tests/helpers.py KERNEL_TOL): 1e-5 for fp32 inputs, 2e-3 for bf16, 5e-4 for fp16.

Why not against an fp32 "truth": rounding the cotangent and the result to bf16 alone already costs ~1.6e-3
(Frobenius, Gaussian data), so 2e-3 against fp32 would leave a kernel almost nothing. Against the once-rounded
reference a kernel's internal error e (relative, before its final rounding) shows up as rounding flips,
roughly sqrt(e * bf16 ulp): casting P and dS to bf16 before their matmuls (plain FlashAttention-2) gives
2.2e-3 (out) and 2.7-3.2e-3 (dq, dk, dv), over the bound; the kernels' fp16 operands on per-(batch, kv head)
power-of-two scaled inputs (see pallas_kernels/flash_attention.py) give <= 1.1e-3.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from helpers import KERNEL_TOL, lower_for_cuda, rel_error
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.segments import block_spans, id_spans

# The package exports the function `flash_attention`, which shadows the submodule attribute of the same name.
fa_mod = importlib.import_module("pallas_kernels.flash_attention")
tri_mod = importlib.import_module("pallas_kernels.flash_attention_triton")  # its Triton kernels

TRITON = "__gpu$xla.gpu.triton"
_rel = rel_error


def _segments(rng, batch, seq):
    """Random packed documents: 2-4 documents per row, random cut points, ids increasing along the row."""
    rows = []
    for _ in range(batch):
        n_docs = int(rng.integers(2, 5))
        cuts = np.sort(rng.choice(np.arange(1, seq), size=n_docs - 1, replace=False))
        row = np.zeros(seq, np.int32)
        for c in cuts:
            row[c:] += 1
        rows.append(row)
    return jnp.asarray(np.stack(rows), jnp.int32)


def _inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype, packed):
    # numpy draws converted on the host: no XLA compiles for test inputs.
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype)))
    q = draw(batch, seq, heads, head_dim)
    k = draw(batch, seq, kv_heads, head_dim)
    v = draw(batch, seq, kv_heads, head_dim)
    do = draw(batch, seq, heads, head_dim)   # the cotangent, in the output dtype
    seg = _segments(rng, batch, seq) if packed else None
    return q, k, v, do, seg


def _fwd_bwd(fn):
    @jax.jit  # one compile for forward + backward (interpret-mode compiles dominate the runtime)
    def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))
    return run


def _check(seed, batch, seq, heads, kv_heads, head_dim, dtype, causal, packed, block_q, block_k, window=None,
           block_q_bwd=None, block_k_bwd=None):
    q, k, v, do, seg = _inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype, packed)
    kw = dict(causal=causal, segment_ids=seg, sliding_window=window)
    ours = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, block_q=block_q, block_k=block_k,
                                                     block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd,
                                                     interpret=True, **kw))(q, k, v, do)
    # The reference on the very same inputs and cotangent: fp32 inside, each result rounded once to `dtype`.
    ref = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, **kw))(q, k, v, do)
    tol = KERNEL_TOL[jnp.dtype(dtype).name]
    errs = {}
    for name, a, r, like in zip(("out", "dq", "dk", "dv"), ours, ref, (q, q, k, v)):
        assert a.shape == like.shape and a.dtype == dtype and r.dtype == dtype, (name, a.shape, a.dtype)
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        errs[name] = _rel(a, r)
    assert max(errs.values()) <= tol, f"relative errors {errs} > {tol:.0e}"
    return errs


# Per dtype (fp32 and bf16) the four kernel paths: causal or not, with or without segment ids (without them the
# block loops split into unmasked and masked blocks; with them they narrow to the tiles' documents). Across them
# vary the GQA ratio (1, which the dk/dv kernel runs without its loop over the group, and 2/4/8, kv_heads 1
# included), head_dim 64/128, ragged seq 40/72 (padded to the blocks inside the wrapper) and exact 64, block_q <,
# = and > block_k. fp16 inputs take the 16-bit path of bf16 (scaled fp16 operands): one case.
CASES = [
    # id, seed, batch, seq, heads, kv_heads, head_dim, dtype, causal, packed, block_q, block_k
    ("f32-mha-causal-seg-d64-s40", 1, 2, 40, 2, 2, 64, jnp.float32, True, True, 16, 32),
    ("f32-mha-full-d128-s72", 2, 1, 72, 2, 2, 128, jnp.float32, False, False, 32, 16),
    ("f32-gqa2-causal-d128-s64", 3, 1, 64, 4, 2, 128, jnp.float32, True, False, 16, 16),
    ("f32-gqa8-full-seg-d128-s40", 8, 1, 40, 8, 1, 128, jnp.float32, False, True, 32, 16),
    ("bf16-mha-causal-seg-d128-s72", 11, 1, 72, 2, 2, 128, jnp.bfloat16, True, True, 32, 16),
    ("bf16-gqa2-causal-d64-s72", 13, 1, 72, 4, 2, 64, jnp.bfloat16, True, False, 32, 32),
    ("bf16-gqa4-full-d128-s40", 16, 1, 40, 8, 2, 128, jnp.bfloat16, False, False, 16, 32),
    ("bf16-gqa8-full-seg-d64-s72", 18, 2, 72, 8, 1, 64, jnp.bfloat16, False, True, 32, 32),
    ("f16-gqa2-causal-seg-d64-s40", 19, 1, 40, 4, 2, 64, jnp.float16, True, True, 16, 16),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attention_matches_reference(case):
    _, seed, batch, seq, heads, kv_heads, head_dim, dtype, causal, packed, bq, bk = case
    _check(seed, batch, seq, heads, kv_heads, head_dim, dtype, causal, packed, bq, bk)


@pytest.mark.parametrize("dtype,causal,window,packed,blocks", [
    (jnp.float32, True, 20, True, (16, 16)),     # window spans ~1.3 blocks: skips kv blocks left of the window
    (jnp.float32, False, 9, False, (32, 16)),    # symmetric window |i - j| < 9
], ids=["f32-causal-w20-seg", "f32-full-w9"])
def test_flash_attention_sliding_window(dtype, causal, window, packed, blocks):
    _check(31 + window, 1, 72, 4, 2, 64, dtype, causal, packed, *blocks, window=window)


def test_flash_attention_bf16_magnitudes_outside_fp16_range():
    """bf16 inputs far outside fp16's range (v ~ 1e6 > 65504, dO ~ 1e-8 < fp16's smallest normal 6e-5, q and k
    scaled by 2**6 and 2**-6) meet the same bound: the kernels' fp16 operands are scaled per (batch, kv head)."""
    q, k, v, do, seg = _inputs(81, 1, 40, 4, 2, 64, jnp.bfloat16, True)
    q, k, v, do = q * 64, k / 64, v * 1e6, do * 1e-8
    kw = dict(causal=False, segment_ids=seg)
    ours = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=32, interpret=True, **kw))(
        q, k, v, do)
    ref = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, **kw))(q, k, v, do)
    errs = {name: _rel(a, r) for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref)}
    assert max(errs.values()) <= KERNEL_TOL["bfloat16"], errs


def test_flash_attention_separate_backward_blocks_and_head_dim_256():
    _check(21, 1, 40, 2, 1, 256, jnp.float32, True, True, 32, 16, block_q_bwd=16, block_k_bwd=32)


def test_flash_attention_window_self_only():
    """sliding_window=1: every query sees only its own key, so out == v and dv == dO (summed over the GQA group),
    and dq == dk == 0 exactly in exact arithmetic.

    A relative error against the reference's exact zeros is undefined (the reference gets them structurally: the
    softmax of a single logit has gradient g - g * 1). The kernel, like FlashAttention-2, forms
    dS = P * (dP - delta) with dP = dO . v from its matmul and delta = rowsum(dO * O) from a separate reduction
    over head_dim; the two dot products of the same vectors round differently (by how much depends on XLA's
    reduction order, which changed between jax 0.10 and 0.11). So dq and dk are held to the fp32 error bound of
    that difference: |dP_ii - delta_i| <= 2 * gamma_d * sum |dO_i * v_i|, gamma_d = d u / (1 - d u), u = 2**-24.
    """
    b, s, h, kvh, d = 1, 72, 4, 2, 64
    group, scale = h // kvh, 1.0 / np.sqrt(d)
    q, k, v, do, _ = _inputs(71, b, s, h, kvh, d, jnp.float32, False)
    out, dq, dk, dv = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, sliding_window=1, block_q=16, block_k=16,
                                                               interpret=True))(q, k, v, do)
    v_h = np.repeat(np.asarray(v, np.float64), group, axis=2)           # [b, s, h, d]: the kv head of each head
    np.testing.assert_allclose(out, v_h, rtol=1e-6, atol=1e-6)
    do64 = np.asarray(do, np.float64)
    np.testing.assert_allclose(dv, do64.reshape(b, s, kvh, group, d).sum(3), rtol=1e-6, atol=1e-6)
    u = 2.0 ** -24
    gamma = d * u / (1 - d * u)
    ds_bound = 2 * gamma * np.sum(np.abs(do64 * v_h), axis=-1, keepdims=True)      # [b, s, h, 1]
    dq_bound = scale * ds_bound * np.abs(np.repeat(np.asarray(k, np.float64), group, axis=2))
    dk_bound = scale * (ds_bound * np.abs(np.asarray(q, np.float64))).reshape(b, s, kvh, group, d).sum(3)
    assert np.all(np.abs(np.asarray(dq, np.float64)) <= 1.01 * dq_bound)
    assert np.all(np.abs(np.asarray(dk, np.float64)) <= 1.01 * dk_bound)


def test_flash_attention_fully_masked_rows_no_nan():
    """Rows with no visible key give 0 output and zero gradients (no NaN) in the kernels and in the reference.

    Through the public API every query sees itself, so fully masked rows only arise inside the kernels: with
    seq=40 padded to 64 and a causal window of 4, padded query rows 43..63 see only padded (masked) keys.
    """
    seq, window = 40, 4
    q, k, v, do, seg = _inputs(41, 1, seq, 4, 2, 64, jnp.float32, True)
    cfg = fa_mod.FlashConfig(backend="triton", causal=True, scale=0.125, window=window, seq_len=seq, block_q=32,
                         block_k=32, block_q_bwd=32, block_k_bwd=32, num_warps=4, num_stages=2,
                         num_warps_bwd=4, num_stages_bwd=2, interpret=True)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 64 - seq)) + ((0, 0),) * (x.ndim - 2))
    qp, kp, vp, dop, segp = map(pad, (q, k, v, do, seg))
    dop = dop.at[:, seq:].set(1.0)  # nonzero cotangent on the fully masked rows
    ones = jnp.ones((1, 2), jnp.float32)
    fwd_sc = jnp.stack([ones * 0.125 * fa_mod.LOG2E, ones], -1)         # fp32: operands are not rescaled
    out, lse = fa_mod.triton_fwd(qp, kp, vp, segp, fwd_sc, cfg, out_dtype=jnp.float32, residual=False)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(out[:, seq + window - 1:] == 0.0) and np.all(np.isfinite(out))
    assert np.all(np.isposinf(lse[:, :, seq + window - 1:])) and np.all(np.isfinite(lse[:, :, :seq]))
    delta = jnp.einsum("bshd,bshd->bhs", out, dop)
    bwd_sc = jnp.stack([ones * 0.125 * fa_mod.LOG2E, ones * 0.125, ones * 0.125, ones], -1)
    dq, dk, dv = fa_mod.triton_bwd(qp, kp, vp, segp, jnp.asarray(lse), delta, dop, bwd_sc, cfg,
                                    out_dtype=jnp.float32)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq)[:, seq + window - 1:] == 0.0)
    assert np.all(np.asarray(dk)[:, seq:] == 0.0) and np.all(np.asarray(dv)[:, seq:] == 0.0)
    # Real rows agree with the reference on the unpadded problem.
    kw = dict(causal=True, segment_ids=seg, sliding_window=window, softmax_scale=0.125)
    ref = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, **kw))(q, k, v, do)
    for a, r in zip((out, dq, dk, dv), ref):
        assert _rel(np.asarray(a)[:, :seq], r) <= 1e-5


def test_reference_fully_masked_row_is_zero(monkeypatch):
    # Force an all-False row into the reference's position mask: output 0 there, gradients finite.
    orig = fa_mod.visible

    def visible(q_pos, k_pos, **kw):
        m = orig(q_pos, k_pos, **kw)
        m = jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool) if m is None else m
        return m.at[3].set(False)

    monkeypatch.setattr(fa_mod, "visible", visible)
    q, k, v, do, _ = _inputs(51, 1, 8, 2, 1, 64, jnp.float32, False)
    out, dq, dk, dv = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, causal=False))(q, k, v, do)
    assert np.all(np.asarray(out)[:, 3] == 0.0)
    for g in (out, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq)[:, 3] == 0.0)


def test_flash_attention_pallas_calls_auto_interpret_and_jit_grad():
    q, k, v, do, seg = _inputs(61, 1, 24, 4, 2, 64, jnp.float32, True)
    fn = lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, block_q=16, block_k=16)  # interpret auto (CPU)
    assert str(jax.make_jaxpr(fn)(q, k, v)).count("pallas_call") == 1
    _, vjp = jax.vjp(fn, q, k, v)
    assert str(jax.make_jaxpr(vjp)(do)).count("pallas_call") == 2  # dk/dv kernel + dq kernel
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.tanh(f(q, k, v))))
    ref = lambda q, k, v: flash_attention_reference(q, k, v, segment_ids=seg)
    ours = jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)
    theirs = jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v)
    for a, b in zip(ours, theirs):
        assert _rel(a, b) <= 1e-5


def test_loop_bounds_skip_masked_blocks():
    """The kv loop of a q block (forward, dq) and the q loop of a kv block (dk/dv) only visit blocks that can hold
    a visible pair: nothing above the causal diagonal, nothing left of / beyond the window, no padded blocks."""
    cfg = lambda causal, window, seq_len: fa_mod.FlashConfig(
        backend="triton", causal=causal, scale=1.0, window=window, seq_len=seq_len, block_q=16, block_k=16,
        block_q_bwd=16, block_k_bwd=16, num_warps=4, num_stages=2, num_warps_bwd=4, num_stages_bwd=2,
        interpret=True)
    kv = lambda q_start, c: tuple(int(x) for x in tri_mod._kv_block_range(q_start, 16, 16, c))
    qr = lambda k_start, c: tuple(int(x) for x in tri_mod._q_block_range(k_start, 16, 16, c))
    assert kv(32, cfg(True, None, 128)) == (0, 3)           # causal: blocks 0..2 for queries 32..47
    assert kv(32, cfg(False, None, 100)) == (0, 7)          # full: all 7 real blocks, not the padded 8th
    assert kv(64, cfg(True, 20, 128)) == (2, 5)             # causal window 20: keys 45..79
    assert kv(64, cfg(False, 20, 128)) == (2, 7)            # symmetric window: keys 45..98
    assert qr(48, cfg(True, None, 100)) == (3, 7)           # dk/dv: q blocks from the diagonal to the last real
    assert qr(48, cfg(True, 20, 128)) == (3, 6)             # ... and not beyond the window (rows <= 82)
    assert qr(48, cfg(False, 20, 128)) == (1, 6)            # rows 29..82


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_block_splits_mask_exactly_where_needed(causal):
    """Without segment ids and window, the loops split into fully visible blocks (no mask) and masked ones (the
    causal diagonal, padded keys). Brute force over block sizes and ragged lengths: every block of the unmasked
    range is fully visible (its mask would be all True), and the two ranges together are the unsplit range."""
    for bq in (16, 32, 64):
        for bk in (16, 32, 64):
            for seq_len in (40, 64, 72, 100, 128):
                sp = -(-seq_len // max(bq, bk)) * max(bq, bk)
                pad = sp != seq_len
                c = fa_mod.FlashConfig(backend="triton", causal=causal, scale=1.0, window=None, seq_len=seq_len,
                                   block_q=bq, block_k=bk, block_q_bwd=bq, block_k_bwd=bk, num_warps=4,
                                   num_stages=2, num_warps_bwd=4, num_stages_bwd=2, interpret=True)
                full = lambda q_start, k_start: (
                    (tri_mod._tile_mask(q_start, bq, k_start, bk, None, None, c, pad) is None)
                    or bool(np.all(np.asarray(tri_mod._tile_mask(q_start, bq, k_start, bk, None, None, c, pad)))))
                for q_start in range(0, sp, bq):                       # forward / dq: kv blocks of a q block
                    lo, mid, hi = (int(x) for x in tri_mod._kv_block_split(q_start, bq, bk, c))
                    assert (lo, hi) == tuple(int(x) for x in tri_mod._kv_block_range(q_start, bq, bk, c))
                    assert lo <= mid <= hi
                    for j in range(lo, hi):
                        assert full(q_start, j * bk) == (j < mid), (bq, bk, seq_len, q_start, j)
                for k_start in range(0, sp, bk):                       # dk / dv: q blocks of a kv block
                    lo, mid, hi = (int(x) for x in tri_mod._q_block_split(k_start, bk, bq, c, pad))
                    assert (lo, hi) == tuple(int(x) for x in tri_mod._q_block_range(k_start, bk, bq, c))
                    assert lo <= mid <= hi
                    for i in range(lo, hi):
                        assert full(i * bq, k_start) == (i >= mid), (bq, bk, seq_len, k_start, i)


@pytest.mark.parametrize("dtype,seq,blocks,split_backward", [
    (jnp.float32, 72, (16, 16, 16, 16), True),
    (jnp.bfloat16, 72, (32, 16, 16, 32), True),
    (jnp.float32, 64, (16, 32, 32, 16), False),
], ids=["f32-s72-b16-bwd-split", "bf16-s72-b32x16-bwd-split", "f32-s64-b16x32-bwd-default"])
def test_flash_attention_causal_unmasked_blocks(dtype, seq, blocks, split_backward, monkeypatch):
    """Plain causal attention over several blocks: the kernels' unmasked block loops (blocks below the diagonal)
    run next to the masked ones (diagonal, ragged last block), forward and backward (the backward split is off
    by default, tri_mod.SPLIT_BACKWARD: on here in both dtypes; off with backward blocks other than the forward's,
    and in CASES' causal cases without segment ids)."""
    monkeypatch.setattr(tri_mod, "SPLIT_BACKWARD", split_backward)
    bq, bk, bqb, bkb = blocks
    _check(91 + seq, 1, seq, 4, 2, 64, dtype, True, False, bq, bk, block_q_bwd=bqb, block_k_bwd=bkb)


def test_package_exports():
    assert pallas_kernels.flash_attention is flash_attention
    assert pallas_kernels.flash_attention_reference is flash_attention_reference


def test_flash_attention_validation():
    q = jnp.zeros((1, 32, 4, 64))
    kv = jnp.zeros((1, 32, 2, 64))
    seg = jnp.zeros((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        flash_attention(q, jnp.zeros((1, 32, 3, 64)), jnp.zeros((1, 32, 3, 64)))
    with pytest.raises(ValueError, match="k .* and v .* same shape"):
        flash_attention(q, kv, jnp.zeros((1, 32, 1, 64)))
    with pytest.raises(ValueError, match="batch"):
        flash_attention(q, jnp.zeros((2, 32, 2, 64)), jnp.zeros((2, 32, 2, 64)))
    with pytest.raises(ValueError, match="seq"):
        flash_attention(q, jnp.zeros((1, 16, 2, 64)), jnp.zeros((1, 16, 2, 64)))
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention(q, jnp.zeros((1, 32, 2, 128)), jnp.zeros((1, 32, 2, 128)))
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        flash_attention(jnp.zeros((1, 32, 4, 96)), jnp.zeros((1, 32, 2, 96)), jnp.zeros((1, 32, 2, 96)))
    with pytest.raises(ValueError, match=r"q must be \[batch, seq, heads, head_dim\]"):
        flash_attention(q[0], kv, kv)
    with pytest.raises(ValueError, match="segment_ids must be"):
        flash_attention(q, kv, kv, segment_ids=jnp.zeros((1, 31), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be an integer"):
        flash_attention(q, kv, kv, segment_ids=seg.astype(jnp.float32))
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(q, kv.astype(jnp.bfloat16), kv)
    with pytest.raises(ValueError, match="dtype must be"):
        flash_attention(q.astype(jnp.int32), kv.astype(jnp.int32), kv.astype(jnp.int32))
    with pytest.raises(ValueError, match="block_q must be a power of two >= 16"):
        flash_attention(q, kv, kv, block_q=48)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        flash_attention(q, kv, kv, block_k=8)
    with pytest.raises(ValueError, match="block_k_bwd"):
        flash_attention(q, kv, kv, block_k_bwd=24)
    with pytest.raises(ValueError, match="sliding_window"):
        flash_attention(q, kv, kv, sliding_window=0)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attention(q, kv, kv, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q, kv, kv, backend="mosaic_gpu")


# ---------------------------------------------------------------------------------------------------------------
# Lowering for cuda (no GPU needed) at Llama-3-8B shapes, bf16
# ---------------------------------------------------------------------------------------------------------------

_lower_cuda = lower_for_cuda


@pytest.mark.parametrize("seq,window", [(8192, None), (4096, 1024)], ids=["s8192", "s4096-window"])
def test_flash_attention_lowers_for_cuda_llama3_8b(seq, window):
    S = jax.ShapeDtypeStruct
    q, kv = S((1, seq, 32, 128), jnp.bfloat16), S((1, seq, 8, 128), jnp.bfloat16)
    seg = S((1, seq), jnp.int32)
    fwd = lambda q, k, v, s: flash_attention(q, k, v, segment_ids=s, sliding_window=window, block_q=128,
                                             block_k=64, interpret=False)
    text = _lower_cuda(fwd, q, kv, kv, seg)
    assert text.count(TRITON) == 1 and "flash_attention_fwd" in text

    def fwd_bwd(q, k, v, s, do):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, s), q, k, v)
        return out, vjp(do)

    text = _lower_cuda(fwd_bwd, q, kv, kv, seg, q)
    assert text.count(TRITON) == 3
    assert "flash_attention_bwd_dkv" in text and "flash_attention_bwd_dq" in text


def test_id_spans_match_brute_force():
    rng = np.random.default_rng(3)
    seg = rng.integers(0, 4, (3, 32))                   # ids reused in several runs
    first, last = (np.asarray(a) for a in id_spans(jnp.asarray(seg)))
    for b in range(3):
        for i in range(32):
            where = np.flatnonzero(seg[b] == seg[b, i])
            assert (first[b, i], last[b, i]) == (where.min(), where.max())
    spans = np.asarray(block_spans(jnp.asarray(seg), 8))
    assert spans.shape == (3, 4, 2)
    np.testing.assert_array_equal(spans[..., 0], first.reshape(3, 4, 8).min(-1))
    np.testing.assert_array_equal(spans[..., 1], last.reshape(3, 4, 8).max(-1) + 1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_documents_skip_other_documents_blocks(causal):
    """Two documents, block-aligned; the first's q, k, v and cotangent are NaN. Every kernel narrows its block loop
    to the blocks where the tile's document ids occur, so the second document's out, dq, dk, dv never touch a NaN
    (a visited block, even fully masked, would: 0 * NaN) and equal the reference's."""
    b, s, h, kvh, d = 1, 128, 2, 1, 64
    q, k, v, do, _ = _inputs(31, b, s, h, kvh, d, jnp.float32, False)
    seg = jnp.asarray(np.repeat([[1, 2]], 64, axis=1), jnp.int32)
    first = (jnp.arange(s) < 64)[None, :, None, None]
    poison = lambda x: jnp.where(first, jnp.nan, x)
    clean = lambda x: jnp.where(first, 0.0, x)
    kw = dict(causal=causal, segment_ids=seg)
    ours = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, block_q=32, block_k=32, interpret=True, **kw))(
        *(poison(x) for x in (q, k, v, do)))
    ref = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, **kw))(*(clean(x) for x in (q, k, v, do)))
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        a, r = np.asarray(a)[:, 64:], np.asarray(r)[:, 64:]
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6, err_msg=name)


def test_reused_segment_ids_span_documents():
    """An id used by two separate runs (documents 1 ... 2 ... 1): its queries see both runs' keys, so the skipped
    range must run from the id's first to its last occurrence, not from the start of the query's own run. Full
    attention, so that every kernel (forward, dq, dk/dv) needs both ends: the first run's queries see the second
    run's keys and the other way round (packed_documents checks the narrowing under the causal bound)."""
    b, s, h, kvh, d = 1, 128, 4, 2, 64
    q, k, v, do, _ = _inputs(32, b, s, h, kvh, d, jnp.float32, False)
    seg = jnp.asarray([[1] * 40 + [2] * 48 + [1] * 40], jnp.int32)
    kw = dict(causal=False, segment_ids=seg)
    ours = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=32, interpret=True, **kw))(
        q, k, v, do)
    ref = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, **kw))(q, k, v, do)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert _rel(a, r) <= KERNEL_TOL["float32"], (name, _rel(a, r))
