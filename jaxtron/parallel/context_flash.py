"""Context parallelism with the flash-attention kernel (``model.attention_impl=pallas``), per device.

The kernel masks causally by index, so it cannot read the load-balanced order (:mod:`jaxtron.parallel.context`)
as one sequence. It need not: rank r holds chunks r and 2C-1-r of every sequence, each a contiguous piece in
order, so every (query chunk, key chunk) pair is fully visible (key chunk earlier), causal (the same chunk) or
invisible (later). Each visible pair is one kernel call returning its output and log-sum-exp
(``flash(q, k, v, q_seg, kv_seg, causal) -> (out, lse)``), and the calls merge by log-sum-exp.

* ``ring`` and ``all_gather``: round t pairs this rank's chunks (r, 2C-1-r) with those of rank
  s = (r - t) mod C, (s, 2C-1-s). Round 0 (s = r) is one causal call on the rank's own two chunks, which are in
  order. In a round t > 0 chunk 2C-1-r sees chunk s fully and chunk r never sees chunk 2C-1-s; chunk r sees
  chunk s if s < r, and otherwise chunk 2C-1-r sees chunk 2C-1-s. So every round is two calls on L x L pieces,
  the same work on every rank (the second pair is picked by ``where`` on the rank's index). The ring receives
  the next block by ``ppermute`` during the round; all_gather slices it from the gathered K/V.
* ``ulysses``: after the exchange a rank has the whole sequence of its heads in the balanced order; a static
  permutation restores the natural order, one causal call runs, and the inverse permutation goes back.

Segment ids travel with their tokens, so packed documents stay exact, and the kernel skips the blocks of other
documents (`pallas_kernels.segments.cross_block_spans`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.parallel.context import balance_order

_F32 = jnp.float32


def _merge(acc, part):
    """(out [b, s, h, d] fp32, lse [b, h, s]) of disjoint key sets -> their union's. ``acc``'s lse is finite
    (every query sees itself in round 0), so a part's -inf rows get weight 0 and no NaN."""
    (o, l), (ob, lb) = acc, part
    m = jnp.maximum(l, lb)
    a, c = jnp.exp(l - m), jnp.exp(lb - m)
    total = a + c
    rows = lambda w: jnp.swapaxes(w / total, 1, 2)[..., None]  # noqa: E731  [b, h, s] -> [b, s, h, 1]
    return o * rows(a) + ob.astype(_F32) * rows(c), m + jnp.log(total)


def _halves(x):
    if x is None:
        return None, None
    n = x.shape[1] // 2
    return x[:, :n], x[:, n:]


def _pick(cond, a, b):
    return None if a is None else jnp.where(cond, a, b)


def zigzag_rounds(q, seg, block, next_block, size: int, rank, flash, tie: bool):
    """This rank's attention (q [b, 2L, h, d]: chunks rank and 2C-1-rank; seg [b, 2L] or None) over ``size``
    rounds; ``block`` = (k, v, kv_seg) of round 0 (this rank's own), ``next_block(block, t)`` that of round t
    (rank (rank - t) mod size). ``tie``: each transfer tied to the previous round's result, as
    ``ring_attention.ring`` does, so XLA overlaps it with the round's attention."""
    o, lse = flash(q, block[0], block[1], seg, block[2], True)
    acc = (o.astype(_F32), lse)
    q_lo, q_hi = _halves(q)
    s_lo, s_hi = _halves(seg)
    nxt = next_block(block, 1) if size > 1 else None
    for t in range(1, size):
        block = nxt
        if tie:
            block, acc = jax.lax.optimization_barrier((block, acc))
        nxt = next_block(block, t + 1) if t + 1 < size else None
        (k_lo, k_hi), (v_lo, v_hi), (ks_lo, ks_hi) = (_halves(x) for x in block)
        oa, la = flash(q_hi, k_lo, v_lo, s_hi, ks_lo, False)
        early = (rank - t) % size < rank            # chunk rank sees chunk s; else 2C-1-rank sees 2C-1-s
        ob, lb = flash(_pick(early, q_lo, q_hi), _pick(early, k_lo, k_hi), _pick(early, v_lo, v_hi),
                       _pick(early, s_lo, s_hi), _pick(early, ks_lo, ks_hi), False)
        none = jnp.full_like(lb, -jnp.inf)
        acc = _merge(acc, (jnp.concatenate([ob, oa], 1), jnp.concatenate([jnp.where(early, lb, none), la], 2)))
        acc = _merge(acc, (jnp.concatenate([ob, ob], 1), jnp.concatenate([none, jnp.where(early, none, lb)], 2)))
    return acc[0].astype(q.dtype)


def ring(q, k, v, seg, axes: tuple[str, ...], size: int, flash):
    """Per device: K/V blocks (with their segment ids) passed round the ring, as ``ring_attention.ring``."""
    perm = [(i, (i + 1) % size) for i in range(size)]
    pass_on = lambda block, t: jax.lax.ppermute(block, axes, perm)  # noqa: E731
    return zigzag_rounds(q, seg, (k, v, seg), pass_on, size, jax.lax.axis_index(axes), flash, tie=True)


def gathered(q, k_all, v_all, seg, kv_seg_all, axes: tuple[str, ...], size: int, flash):
    """Per device: q and its ids split over ``axes``, K/V (and their ids) the whole balanced sequence."""
    rank = jax.lax.axis_index(axes)
    n = q.shape[1]

    def block_of(_, t):
        start = ((rank - t) % size) * n
        cut = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)  # noqa: E731
        return cut(k_all), cut(v_all), cut(kv_seg_all)

    return zigzag_rounds(q, seg, block_of(None, 0), block_of, size, rank, flash, tie=False)


def ulysses(q, k, v, seg, axes: tuple[str, ...], size: int, flash):
    """Per device: all-to-all to the whole sequence of 1/C of the heads, natural order, one causal call, back."""
    to_heads = lambda x: jax.lax.all_to_all(x, axes, 2, 1, tiled=True)  # noqa: E731
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    order = balance_order(q.shape[1], size)
    natural = jnp.asarray(np.argsort(order))
    forward = lambda x: None if x is None else jnp.take(x, natural, axis=1)  # noqa: E731
    if seg is not None:
        seg = jax.lax.all_gather(seg, axes, axis=1, tiled=True)
    out = flash(forward(q), forward(k), forward(v), forward(seg), forward(seg), True)[0]
    out = jnp.take(out, jnp.asarray(order), axis=1)
    return jax.lax.all_to_all(out, axes, 1, 2, tiled=True)
