"""The grouped matmul kernels (pallas_kernels.grouped_matmul): interpret-mode numerics against jax.lax.ragged_dot,
the work list, and lowering for cuda on the CPU.

Accuracy criterion: as for the other kernels (tests/test_kernels_rope_swiglu.py): the reference runs on the same
inputs and cotangent, and the output and both gradients satisfy ||kernel - reference|| / ||reference|| <=
KERNEL_TOL[dtype]. bf16 is also checked elementwise against the exact fp32 result: within half a bf16 ulp (one
rounding of an fp32 accumulation).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import KERNEL_TOL, lower_for_cuda, rel_error
from pallas_kernels.grouped_matmul import gmm, gmm_reference, schedule

TRITON = "__gpu$xla.gpu.triton"
TILES = (16, 16, 16)


def _rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))


def _fwd_bwd(fn, sizes):
    """jit(output, (d_lhs, d_rhs)) of fn(lhs, rhs, group_sizes) for a cotangent."""
    group_sizes = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def run(lhs, rhs, ct):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes), lhs, rhs)
        return (out, *vjp(ct))

    return run


def _kernel(**kw):
    return lambda a, b, g: gmm(a, b, g, interpret=True, tiling=TILES, **kw)


def _problem(seed, sizes, m, k, n, dtype):
    rng = np.random.default_rng(seed)
    return _rand(rng, (m, k), dtype), _rand(rng, (len(sizes), k, n), dtype), _rand(rng, (m, n), dtype)


# ---------------------------------------------------------------------------------------------------------------
# The work list
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes,m", [
    ([5, 0, 20, 3], 37),        # empty group, boundaries inside tiles, rows past the sum
    ([0, 0, 37, 0], 37),        # one group, empty groups around it
    ([16, 32, 16], 64),         # boundaries on tile edges
    ([3, 3, 3, 3, 3, 3], 18),   # every tile straddles: the most items (num_tiles + G - 1)
    ([0, 0, 0], 20),            # nothing: every tile stores zeros
    ([5, 9, 30], 40),           # sum past M: cut at M, as ragged_dot does
])
def test_schedule_stores_every_row_once_from_its_group(sizes, m):
    tm = 16
    tiles = -(-m // tm)
    meta = np.asarray(jax.jit(schedule, static_argnums=(1, 2, 3))(jnp.asarray(sizes, jnp.int32), m, tm, tiles))
    assert meta.shape == (tiles + len(sizes) - 1, 8)
    ends = np.minimum(np.cumsum(sizes), m)
    group_of = np.searchsorted(ends, np.arange(tiles * tm), side="right")   # len(sizes): past the sum
    stored = np.zeros(tiles * tm, int)
    for g, tile, v_lo, v_hi, own_lo, own_hi, _, _ in meta:
        assert tile * tm <= own_lo <= own_hi <= (tile + 1) * tm
        stored[own_lo:own_hi] += 1
        rows = np.arange(v_lo, v_hi)
        assert np.all(group_of[rows] == g)                          # it loads only its group's rows ...
        owned = np.arange(own_lo, own_hi)
        assert np.all((group_of[owned] == g) | (group_of[owned] == len(sizes)))   # ... or stores zeros
        mine = owned[group_of[owned] == g]
        assert np.all((mine >= v_lo) & (mine < v_hi))               # and every row it owns of its group it loads
    np.testing.assert_array_equal(stored, 1)


# ---------------------------------------------------------------------------------------------------------------
# Numerics against ragged_dot (interpret mode)
# ---------------------------------------------------------------------------------------------------------------

CASES = {   # sizes, M, K, N: M, K and N off the tiles are padded inside
    "ragged": ([5, 0, 20, 3], 37, 24, 40),
    "one_group": ([0, 0, 37, 0], 37, 32, 20),
    "aligned": ([16, 32, 16], 64, 32, 32),
    "sum_past_m": ([5, 9, 30], 40, 16, 24),
}


def _check(actual, expected, dtype, exact=None):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    err = rel_error(actual, expected)
    tol = KERNEL_TOL[jnp.dtype(dtype).name]
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    if exact is not None:   # one rounding of the fp32 result: within half a bf16 ulp (2**-8 relative)
        np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(exact, np.float32),
                                   rtol=2.0 ** -8 + 1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,case", [(jnp.float32, c) for c in CASES] + [
    (jnp.bfloat16, "ragged"), (jnp.bfloat16, "sum_past_m")], ids=lambda v: getattr(v, "__name__", v))
def test_gmm_and_gradients_match_ragged_dot(dtype, case):
    sizes, m, k, n = CASES[case]
    args = _problem(0, sizes, m, k, n, dtype)
    ours = _fwd_bwd(_kernel(), sizes)(*args)
    ref = _fwd_bwd(gmm_reference, sizes)(*args)
    exact = [None] * 3
    if dtype == jnp.bfloat16:
        exact = _fwd_bwd(gmm_reference, sizes)(*(a.astype(jnp.float32) for a in args))
    for a, r, e in zip(ours, ref, exact):
        _check(a, r, dtype, e)
    total = min(sum(sizes), m)
    assert not np.asarray(ours[0][total:]).any() and not np.asarray(ours[1][total:]).any()   # rows past the sum


def test_empty_groups_only_give_zeros():
    args = _problem(1, [0, 0, 0], 20, 16, 16, jnp.float32)
    out, d_lhs, d_rhs = _fwd_bwd(_kernel(), [0, 0, 0])(*args)
    assert out.shape == (20, 16) and d_rhs.shape == (3, 16, 16)
    for x in (out, d_lhs, d_rhs):
        assert not np.asarray(x).any()


def test_bf16_with_fp32_output():
    """preferred_element_type=float32: fp32 output; the cotangent is rounded to the inputs' dtype as it is
    loaded (exact here, as in the MoE layer, where it is the transpose of a cast from bf16)."""
    sizes = [7, 0, 21]
    lhs, rhs, ct = _problem(2, sizes, 33, 32, 16, jnp.bfloat16)
    ct = ct.astype(jnp.float32)
    ours = _fwd_bwd(_kernel(preferred_element_type=jnp.float32), sizes)(lhs, rhs, ct)
    ref = _fwd_bwd(lambda a, b, g: gmm_reference(a, b, g, preferred_element_type=jnp.float32), sizes)(lhs, rhs, ct)
    assert ours[0].dtype == jnp.float32 and ours[1].dtype == ours[2].dtype == jnp.bfloat16
    _check(ours[0], ref[0], jnp.float32)
    for a, r in zip(ours[1:], ref[1:]):
        _check(a, r, jnp.bfloat16)


def test_values_outside_the_groups_do_not_leak():
    """Rows past the sum hold inf in lhs and in the cotangent: the masked loads keep them out of every result."""
    sizes = [6, 0, 13]
    lhs, rhs, ct = _problem(3, sizes, 30, 16, 16, jnp.float32)
    bad_lhs, bad_ct = lhs.at[19:].set(jnp.inf), ct.at[19:].set(jnp.inf)
    ours = _fwd_bwd(_kernel(), sizes)(bad_lhs, rhs, bad_ct)
    ref = _fwd_bwd(gmm_reference, sizes)(lhs.at[19:].set(0), rhs, ct.at[19:].set(0))
    for a, r in zip(ours, ref):
        assert np.isfinite(np.asarray(a)).all()
        _check(a, r, jnp.float32)


def test_vmap_and_grad_under_jit():
    """A batch of problems, each with its own group sizes (vmap adds a grid axis to every kernel)."""
    rng = np.random.default_rng(4)
    lhs, rhs = _rand(rng, (2, 40, 16), jnp.float32), _rand(rng, (2, 3, 16, 32), jnp.float32)
    sizes = jnp.asarray([[5, 0, 30], [20, 20, 0]], jnp.int32)
    loss = lambda f: (lambda a, b, g: jnp.sum(jnp.tanh(f(a, b, g))))
    ours = jax.jit(jax.vmap(jax.value_and_grad(loss(_kernel()), (0, 1))))(lhs, rhs, sizes)
    ref = jax.jit(jax.vmap(jax.value_and_grad(loss(gmm_reference), (0, 1))))(lhs, rhs, sizes)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for a, r in zip(ours[1], ref[1]):
        _check(a, r, jnp.float32)


def test_backward_is_two_kernels_and_auto_interpret():
    lhs, rhs, ct = _problem(5, [3, 5], 8, 16, 16, jnp.float32)
    group_sizes = jnp.asarray([3, 5], jnp.int32)
    fn = lambda a, b: gmm(a, b, group_sizes)      # interpret=None: interpreted on the CPU
    fwd = str(jax.make_jaxpr(fn)(lhs, rhs))
    assert fwd.count("pallas_call") == 1 and "interpret=True" in fwd
    fwd_bwd = lambda a, b, c: jax.vjp(fn, a, b)[1](c)
    assert str(jax.make_jaxpr(fwd_bwd)(lhs, rhs, ct)).count("pallas_call") == 3


def test_validation():
    lhs, rhs, gs = jnp.zeros((8, 16)), jnp.zeros((2, 16, 16)), jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="disagree on K"):
        gmm(lhs, jnp.zeros((2, 8, 16)), gs)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, jnp.asarray([4, 4, 0], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="share a dtype"):
        gmm(lhs, rhs.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="lhs \\[M, K\\]"):
        gmm(lhs[None], rhs, gs)
    with pytest.raises(ValueError, match="power of two"):
        gmm(lhs, rhs, gs, tiling=(16, 24, 16))
    with pytest.raises(ValueError, match="power of two"):
        gmm(lhs, rhs, gs, tiling=(8, 16, 16))
    with pytest.raises(ValueError, match="non-empty"):
        gmm(jnp.zeros((0, 16)), rhs, gs)


# ---------------------------------------------------------------------------------------------------------------
# Lowering for cuda (no GPU needed), Mixtral-like expert shapes, bf16
# ---------------------------------------------------------------------------------------------------------------

def test_gmm_lowers_for_cuda():
    S = jax.ShapeDtypeStruct
    m, k, n, g = 4096, 1024, 2048, 8
    lhs, rhs, gs, ct = S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32), \
        S((m, n), jnp.bfloat16)
    fwd = lambda a, b, s: gmm(a, b, s, interpret=False)
    text = lower_for_cuda(fwd, lhs, rhs, gs)
    assert text.count(TRITON) == 1 and 'name = "gmm"' in text

    def fwd_bwd(a, b, s, c):
        out, vjp = jax.vjp(lambda a, b: fwd(a, b, s), a, b)
        return out, vjp(c)

    text = lower_for_cuda(fwd_bwd, lhs, rhs, gs, ct)
    assert text.count(TRITON) == 3
    assert all(f'name = "{name}"' in text for name in ("gmm", "gmm_t", "tgmm"))
