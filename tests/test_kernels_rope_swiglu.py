"""RoPE and SwiGLU Pallas kernels: interpret-mode numerics vs jnp references, and cuda lowering on the CPU.

Accuracy criterion: as for flash attention (tests/test_kernels_flash_attention.py's docstring): the reference runs
on the same inputs and the same cotangent (fp32 inside, rounded once to the input dtype), and the output and every
gradient must satisfy ||kernel - reference|| / ||reference|| <= 1e-5 (fp32 inputs) or 2e-3 (bf16). On top of it,
elementwise: fp32 within rtol 1e-5, and bf16 within half a bf16 ulp of the exact fp32 result.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import KERNEL_TOL, lower_for_cuda, rel_error
from pallas_kernels.rope import apply_rope, rope_inv_freq, rope_reference
from pallas_kernels.swiglu import swiglu, swiglu_reference

TRITON = "__gpu$xla.gpu.triton"
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _close(actual, expected, dtype):
    """fp32: `expected` is the fp32 reference. bf16: `expected` = (the reference run on the same bf16 inputs and
    cotangent, the exact fp32 result). Returns the criterion's relative error."""
    a = np.asarray(actual, np.float32)
    ref = expected if dtype == jnp.float32 else expected[0]
    assert actual.dtype == dtype and ref.dtype == dtype, (actual.dtype, ref.dtype)
    err = rel_error(actual, ref)
    tol = KERNEL_TOL[jnp.dtype(dtype).name]
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"
    if dtype == jnp.float32:
        exp = np.asarray(expected, np.float32)
        # elements near zero come out of sums of terms as large as the tensor's: their error is fp32's at
        # that scale (an LLVM optimization level alone moves it by a few ulps of the largest element)
        np.testing.assert_allclose(a, exp, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(exp).max())))
        return err
    exp_bf16, exp_f32 = (np.asarray(e, np.float32) for e in expected)
    # A rounding flip between two fp32 values straddling a bf16 midpoint is one bf16 ulp (2**-7 relative):
    # allow it for a tiny fraction of elements; everything else must be within 2e-3.
    bad = ~np.isclose(a, exp_bf16, rtol=2e-3, atol=1e-5)
    assert bad.sum() <= max(2, 1e-3 * bad.size), f"{bad.sum()} / {bad.size} bf16 elements off by more than 2e-3"
    np.testing.assert_allclose(a[bad], exp_bf16[bad], rtol=2.0 ** -7 + 1e-5, atol=1e-5)
    # Kernel output = fp32 math + one bf16 rounding: within half a bf16 ulp (2**-8 relative) of the fp32 result.
    np.testing.assert_allclose(a, exp_f32, rtol=2.0 ** -8 + 1e-5, atol=1e-5)
    return err


def _rand(rng, shape, dtype, scale=1.0):
    # numpy RNG and numpy dtype conversion: no XLA compiles for test inputs.
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype))


ERRORS = {}  # case -> {output or gradient: relative error}, for reports


def _count_pallas_calls(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


# ---------------------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------------------

def _hf_llama3_inv_freq(head_dim, theta, rs):
    """Direct transcription of transformers' _compute_default_rope_parameters + _compute_llama3_parameters
    (torch replaced by numpy, float64)."""
    base = theta
    dim = head_dim
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
    factor = rs["factor"]
    low_freq_factor = rs["low_freq_factor"]
    high_freq_factor = rs["high_freq_factor"]
    old_context_len = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_llama3_inv_freq_matches_hf(head_dim, theta):
    ours = np.asarray(rope_inv_freq(head_dim, theta, LLAMA3_SCALING))
    assert ours.dtype == np.float32 and ours.shape == (head_dim // 2,)
    np.testing.assert_allclose(ours, _hf_llama3_inv_freq(head_dim, theta, LLAMA3_SCALING), rtol=2e-6)
    # All three regimes (unscaled, smoothed, fully scaled) occur for theta=500000, head_dim=128 (Llama-3.1-8B).
    plain = np.asarray(rope_inv_freq(head_dim, theta))
    np.testing.assert_allclose(plain, 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim), rtol=2e-6)
    if head_dim == 128 and theta == 500000.0:
        ratio = plain / ours
        assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 8.0))
        assert np.any((ratio > 1.01) & (ratio < 7.99))


def _rope_case(seed, batch, seq, heads, kv_heads, head_dim, dtype, packed=False, theta=10000.0, scaling=None):
    rng = np.random.default_rng(seed)
    q = _rand(rng, (batch, seq, heads, head_dim), dtype)
    k = _rand(rng, (batch, seq, kv_heads, head_dim), dtype)
    if packed:  # two documents per row: positions restart at 0 mid-sequence
        cut = seq // 2 + 1
        row = np.concatenate([np.arange(cut), np.arange(seq - cut)])
    else:
        row = np.arange(seq) + 100  # offset: exercise non-trivial angles
    positions = jnp.asarray(np.tile(row, (batch, 1)), jnp.int32)
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    gq = _rand(rng, q.shape, dtype)
    gk = _rand(rng, k.shape, dtype)
    return q, k, positions, inv_freq, gq, gk


def _check_rope(q, k, positions, inv_freq, gq, gk, dtype, block_seq=16):
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))

    @jax.jit  # one compile for forward + backward (interpret mode compiles are the slow part)
    def fwd_bwd(q, k, gq, gk):
        outs, vjp = jax.vjp(lambda q, k: apply_rope(q, k, positions, inv_freq, interpret=True,
                                                    block_seq=block_seq), q, k)
        return outs, vjp((gq, gk))

    (qo, ko), (dq, dk) = fwd_bwd(q, k, gq, gk)
    assert qo.dtype == dtype and ko.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    ref = lambda q, k: (rope_reference(q, positions, inv_freq), rope_reference(k, positions, inv_freq))

    @jax.jit
    def ref_fwd_bwd(q, k, gq, gk):
        outs, vjp_ref = jax.vjp(ref, q, k)
        return outs, vjp_ref((gq, gk))

    (qr, kr), (dqr, dkr) = ref_fwd_bwd(f32(q), f32(k), f32(gq), f32(gk))  # fp32 reference on the same inputs
    assert dq.dtype == dtype and dk.dtype == dtype
    if dtype == jnp.bfloat16:  # also the reference run in bf16
        (qb, kb), (dqb, dkb) = ref_fwd_bwd(q, k, gq, gk)
        qr, kr, dqr, dkr = (qb, qr), (kb, kr), (dqb, dqr), (dkb, dkr)
    ERRORS[f"rope-{jnp.dtype(dtype).name}-kv{k.shape[2]}-d{q.shape[-1]}"] = {
        name: _close(a, r, dtype) for name, a, r in (("q_out", qo, qr), ("k_out", ko, kr), ("dq", dq, dqr),
                                                       ("dk", dk, dkr))}
    return fwd_bwd


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_gqa_ragged(kv_heads, dtype):
    # seq 37 is padded to one 64-row block inside the wrapper and sliced back.
    args = _rope_case(0, batch=2, seq=37, heads=8, kv_heads=kv_heads, head_dim=64, dtype=dtype)
    _check_rope(*args, dtype, block_seq=64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_head_dim_128_packed_llama3(dtype):
    args = _rope_case(1, batch=1, seq=37, heads=8, kv_heads=2, head_dim=128, dtype=dtype, packed=True,
                      theta=500000.0, scaling=LLAMA3_SCALING)
    assert int(args[2][0, 19]) == 0 and int(args[2][0, 18]) == 18
    _check_rope(*args, dtype, block_seq=32)


def test_rope_multiblock_exact_and_inverse():
    # seq a multiple of the block (no padding), several sequence blocks.
    q, k, positions, inv_freq, gq, gk = _rope_case(2, batch=1, seq=64, heads=8, kv_heads=8, head_dim=64,
                                                   dtype=jnp.float32)
    fwd_bwd = _check_rope(q, k, positions, inv_freq, gq, gk, jnp.float32, block_seq=16)
    # The backward rotates by -angle: the vjp applied to the forward output recovers the input.
    (qo, ko), _ = fwd_bwd(q, k, gq, gk)
    _, (qb, kb) = fwd_bwd(q, k, qo, ko)
    _close(qb, q, jnp.float32)
    _close(kb, k, jnp.float32)


def test_rope_backward_is_pallas_and_auto_interpret():
    q, k, positions, inv_freq, gq, gk = _rope_case(3, 1, 37, 8, 2, 64, jnp.float32)
    fwd = lambda q, k: apply_rope(q, k, positions, inv_freq, block_seq=16)  # interpret=None: auto on the CPU
    assert _count_pallas_calls(fwd, q, k) == 2  # one pallas_call per tensor
    _, vjp = jax.vjp(fwd, q, k)
    assert _count_pallas_calls(lambda a, b: vjp((a, b)), gq, gk) == 2
    qo, _ = jax.jit(fwd)(q, k)
    _close(qo, jax.jit(rope_reference)(q, positions, inv_freq), jnp.float32)


def test_rope_validation():
    q = jnp.zeros((1, 8, 8, 64))
    k = jnp.zeros((1, 8, 2, 64))
    pos = jnp.zeros((1, 8), jnp.int32)
    f = rope_inv_freq(64, 10000.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        apply_rope(q, jnp.zeros((1, 8, 3, 64)), pos, f)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q, k, jnp.zeros((1, 9), jnp.int32), f)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q, k, jnp.zeros((1, 8), jnp.float32), f)
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope(q, k, pos, f[:16])
    with pytest.raises(ValueError, match="batch, seq"):
        apply_rope(q[0], k, pos, f)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(q, jnp.zeros((1, 8, 2, 32)), pos, f)
    with pytest.raises(ValueError, match="power of two"):
        apply_rope(q, k, pos, f, block_seq=48)
    with pytest.raises(ValueError, match="backend"):
        apply_rope(q, k, pos, f, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="even"):
        rope_inv_freq(63, 10000.0)


# ---------------------------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,blocks", [
    ((3, 37, 100), (16, 64)),    # ragged rows and features, several blocks
    ((64, 256), (16, 128)),      # exact multiple of the blocks
    ((5,), (16, 1024)),          # 1-D, blocks clamped
    ((2, 3, 4, 33), (4, 16)),    # 4-D leading shape
], ids=["ragged3d", "exact2d", "1d", "4d"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_matches_reference(shape, blocks, dtype):
    rng = np.random.default_rng(len(shape))
    gate = _rand(rng, shape, dtype, scale=3.0)
    up = _rand(rng, shape, dtype)
    ct = _rand(rng, shape, dtype)
    br, bc = blocks
    @jax.jit
    def fwd_bwd(gate, up, ct):
        out, vjp = jax.vjp(lambda g, u: swiglu(g, u, interpret=True, block_rows=br, block_cols=bc), gate, up)
        return out, vjp(ct)

    out, (dg, du) = fwd_bwd(gate, up, ct)
    assert out.dtype == dtype and out.shape == shape
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))

    @jax.jit
    def ref_fwd_bwd(gate, up, ct):
        out, vjp_ref = jax.vjp(swiglu_reference, gate, up)
        return out, vjp_ref(ct)

    ref, (dgr, dur) = ref_fwd_bwd(f32(gate), f32(up), f32(ct))
    assert dg.dtype == dtype and du.dtype == dtype
    if dtype == jnp.bfloat16:  # also the reference run in bf16
        refb, (dgb, dub) = ref_fwd_bwd(gate, up, ct)
        ref, dgr, dur = (refb, ref), (dgb, dgr), (dub, dur)
    ERRORS[f"swiglu-{jnp.dtype(dtype).name}-{shape}"] = {
        name: _close(a, r, dtype) for name, a, r in (("out", out, ref), ("dgate", dg, dgr), ("dup", du, dur))}


def test_swiglu_backward_is_pallas_and_jit_grad():
    rng = np.random.default_rng(7)
    gate = _rand(rng, (4, 9, 48), jnp.float32, 2.0)
    up = _rand(rng, (4, 9, 48), jnp.float32)
    fn = lambda g, u: swiglu(g, u, block_rows=8, block_cols=32)
    assert _count_pallas_calls(fn, gate, up) == 1
    _, vjp = jax.vjp(fn, gate, up)
    assert _count_pallas_calls(vjp, up) == 1
    loss = lambda f: (lambda g, u: jnp.sum(jnp.tanh(f(g, u))))
    ours = jax.jit(jax.grad(loss(fn), (0, 1)))(gate, up)
    ref = jax.jit(jax.grad(loss(swiglu_reference), (0, 1)))(gate, up)
    for a, b in zip(ours, ref):
        _close(a, b, jnp.float32)


def test_swiglu_validation():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="same shape"):
        swiglu(x, jnp.zeros((4, 9)))
    with pytest.raises(ValueError, match="dtype"):
        swiglu(x, x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="power of two"):
        swiglu(x, x, block_cols=100)
    with pytest.raises(ValueError, match="backend"):
        swiglu(x, x, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="non-empty"):
        swiglu(jnp.zeros(()), jnp.zeros(()))


# ---------------------------------------------------------------------------------------------------------------
# Lowering for cuda (no GPU needed) at Llama-3-8B shapes, bf16
# ---------------------------------------------------------------------------------------------------------------

_lower_cuda = lower_for_cuda


def test_rope_lowers_for_cuda_llama3_8b():
    S = jax.ShapeDtypeStruct
    q, k = S((1, 8192, 32, 128), jnp.bfloat16), S((1, 8192, 8, 128), jnp.bfloat16)
    pos, f = S((1, 8192), jnp.int32), S((64,), jnp.float32)
    fwd = lambda q, k, p, f: apply_rope(q, k, p, f, interpret=False)
    text = _lower_cuda(fwd, q, k, pos, f)
    assert text.count(TRITON) == 2

    def fwd_bwd(q, k, p, f, gq, gk):
        _, vjp = jax.vjp(lambda q, k: fwd(q, k, p, f), q, k)
        return vjp((gq, gk))

    text = _lower_cuda(fwd_bwd, q, k, pos, f, q, k)
    assert text.count(TRITON) >= 4 and "rope_fwd" in text and "rope_bwd" in text  # 2 forward + 2 backward


def test_swiglu_lowers_for_cuda_llama3_8b():
    x = jax.ShapeDtypeStruct((8192, 14336), jnp.bfloat16)
    fwd = lambda g, u: swiglu(g, u, interpret=False)
    text = _lower_cuda(fwd, x, x)
    assert text.count(TRITON) == 1 and "swiglu_fwd" in text

    def fwd_bwd(g, u, ct):
        out, vjp = jax.vjp(fwd, g, u)
        return out, vjp(ct)

    text = _lower_cuda(fwd_bwd, x, x, x)
    assert text.count(TRITON) == 2 and "swiglu_bwd" in text
