"""flash_attention_lse: the flash kernel's output and log-sum-exp, differentiable through both, on query and key
pieces with their own segment ids (context parallelism's pieces), against the jnp reference (interpret mode).

Accuracy criterion as in test_kernels_flash_attention.py (same inputs and cotangents, relative Frobenius error,
KERNEL_TOL). The loss reads the lse too, so the lse's gradient path (delta - d lse in the backward) is checked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import KERNEL_TOL, rel_error
from pallas_kernels.flash_attention_lse import flash_attention_lse, flash_attention_lse_reference
from pallas_kernels.segments import block_spans, cross_block_spans

# queries of documents 1 and 2; keys of documents 0, 1, 2 (row 0) and 2, 3 (row 1): the first query rows of
# row 0 see no key under causal masking (their document's keys start later), row 1's document 3 queries see
# only part of theirs
Q_SEG = np.array([[1] * 20 + [2] * 28, [3] * 48], np.int32)
KV_SEG = np.array([[0] * 10 + [1] * 30 + [2] * 8, [2] * 20 + [3] * 28], np.int32)


@pytest.mark.parametrize("dtype,causal", [("float32", True), ("float32", False), ("bfloat16", True)])
def test_flash_attention_lse_matches_reference(dtype, causal):
    b, s, h, kvh, d = 2, 48, 4, 2, 16
    keys = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(keys[0], (b, s, h, d), dtype)
    k, v = (jax.random.normal(x, (b, s, kvh, d), dtype) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], (b, s, h, d), dtype)
    d_lse = jax.random.normal(keys[4], (b, h, s), jnp.float32)
    seg, kv_seg = jnp.asarray(Q_SEG), jnp.asarray(KV_SEG)

    def run(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v, causal=causal, segment_ids=seg, kv_segment_ids=kv_seg)
            seen = jnp.isfinite(lse)
            return (jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
                    + jnp.sum(jnp.where(seen, lse, 0.0) * d_lse)), (out, lse)
        # jitted: one compile, not an eager dispatch (and compile) per op of the kernels' wrappers and the reference
        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, lse, grads

    out, lse, grads = run(flash_attention_lse)
    ref_out, ref_lse, ref_grads = run(flash_attention_lse_reference)
    empty = np.isinf(np.asarray(ref_lse))
    assert empty.any() == causal                      # causal: row 0's first document-1 queries see no key
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[np.moveaxis(empty, 1, 2)], 0.0)
    tol = KERNEL_TOL[dtype]
    assert rel_error(out, ref_out) < tol
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-5, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_error(g, r) < tol, name


def test_lse_merges_two_key_pieces_into_the_whole():
    """Attention over keys [0, 2L) = the log-sum-exp merge of the causal call on the diagonal piece and the full
    call on the earlier piece: what the context-parallel rounds rely on."""
    b, n, h, d = 1, 32, 2, 16
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(x, (b, 2 * n, h, d)) for x in keys)
    attn = jax.jit(flash_attention_lse, static_argnames="causal")     # one compile per call, not one per op
    whole, whole_lse = attn(q, k, v, causal=True)
    diag, l1 = attn(q[:, n:], k[:, n:], v[:, n:], causal=True)
    early, l2 = attn(q[:, n:], k[:, :n], v[:, :n], causal=False)
    lse = jnp.logaddexp(l1, l2)
    w = lambda part: jnp.swapaxes(jnp.exp(part - lse), 1, 2)[..., None]  # noqa: E731
    np.testing.assert_allclose(w(l1) * diag + w(l2) * early, whole[:, n:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, whole_lse[..., n:], rtol=1e-6)


def test_cross_block_spans_match_brute_force():
    rng = np.random.default_rng(4)
    seg, other = rng.integers(0, 5, (2, 3, 32))
    spans = np.asarray(cross_block_spans(jnp.asarray(seg), jnp.asarray(other), 8))
    for b in range(3):
        for blk in range(4):
            ids = set(seg[b, blk * 8:(blk + 1) * 8])
            where = np.flatnonzero(np.isin(other[b], list(ids)))
            lo, hi = spans[b, blk]
            if where.size:
                assert (lo, hi) == (where.min(), where.max() + 1)
            else:
                assert lo >= hi
    same = jnp.asarray(seg)
    np.testing.assert_array_equal(cross_block_spans(same, same, 8), block_spans(same, 8))


def test_kv_segment_ids_need_the_query_ids_and_triton():
    x = jnp.zeros((1, 16, 1, 16))
    ids = jnp.ones((1, 16), jnp.int32)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        flash_attention_lse(x, x, x, kv_segment_ids=ids)
    from pallas_kernels.flash_attention import prepare

    with pytest.raises(ValueError, match="kv_segment_ids"):
        prepare(x, x, x, causal=True, segment_ids=ids, kv_segment_ids=ids, softmax_scale=None,
                 sliding_window=None, block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None,
                 num_warps=None, num_stages=None, num_warps_bwd=None, num_stages_bwd=None, interpret=True,
                 backend="mosaic", fuse_dq=None)
