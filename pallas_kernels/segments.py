"""Document spans of packed rows, for skipping the blocks no query of a tile can see (no jaxtron imports).

With segment ids, a query sees only keys of its own id. Whatever the layout of the ids (one run per document,
or an id used by several runs), every position sharing an id with position r lies between the first and the
last occurrence of that id in the row; over a block of positions, between the smallest first and the largest
last occurrence. The kernels narrow their block loops to that range, so a query tile of one document never
visits the keys of the documents before (or, without causal masking, after) it. When queries and keys are
different pieces of a sequence (context parallelism's blocks), their ids come as two rows and the range is
where the block's ids occur among the other row's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def id_spans(seg):
    """seg [b, s] int -> (first, last) [b, s] int32: where the id at each position first and last occurs in its
    row."""
    b, s = seg.shape
    order = jnp.argsort(seg, axis=1, stable=True)        # equal ids stay in position order
    ids = jnp.take_along_axis(seg, order, axis=1)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    change = ids[:, 1:] != ids[:, :-1]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), change], axis=1)
    ends = jnp.concatenate([change, jnp.ones((b, 1), bool)], axis=1)
    group_start = lax.cummax(jnp.where(starts, pos, 0), axis=1)
    group_end = lax.cummin(jnp.where(ends, pos, s - 1), axis=1, reverse=True)
    first = jnp.take_along_axis(order, group_start, axis=1)
    last = jnp.take_along_axis(order, group_end, axis=1)
    back = jnp.argsort(order, axis=1)                    # sorted slot of each position
    return (jnp.take_along_axis(first, back, axis=1).astype(jnp.int32),
            jnp.take_along_axis(last, back, axis=1).astype(jnp.int32))


def block_spans(seg, block: int):
    """seg [b, s] (s a multiple of block) -> [b, s // block, 2] int32: for each block of positions, [lo, hi) holding
    every position that shares an id with one of the block's."""
    b, s = seg.shape
    first, last = id_spans(seg)
    lo = first.reshape(b, s // block, block).min(axis=2)
    hi = last.reshape(b, s // block, block).max(axis=2) + 1
    return jnp.stack([lo, hi], axis=2)


def cross_block_spans(seg, other, block: int):
    """seg, other [b, s] -> [b, s // block, 2] int32: for each block of ``seg``'s positions, [lo, hi) of ``other``'s
    positions holding one of the block's ids (lo >= hi when none does)."""
    b, s = seg.shape
    order = jnp.argsort(other, axis=1, stable=True)
    ids = jnp.take_along_axis(other, order, axis=1)
    search = jax.vmap(lambda row, x, side: jnp.searchsorted(row, x, side=side), in_axes=(0, 0, None))
    lo_i = search(ids, seg, "left")
    hi_i = search(ids, seg, "right") - 1
    present = lo_i <= hi_i
    first = jnp.where(present, jnp.take_along_axis(order, jnp.minimum(lo_i, s - 1), axis=1), s)
    last = jnp.where(present, jnp.take_along_axis(order, jnp.maximum(hi_i, 0), axis=1), -1)
    lo = first.reshape(b, s // block, block).min(axis=2)
    hi = last.reshape(b, s // block, block).max(axis=2) + 1
    return jnp.stack([lo, hi], axis=2).astype(jnp.int32)
