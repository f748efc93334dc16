"""Attention over a sequence split across the ``context`` mesh axis: the ring and Ulysses context_impls.

The model calls :func:`sequence_attention` with logical names only. Under the rules of ``ring`` the K/V
sequence (``act_kv_seq``) stays split over ``context``, so attention runs per device in a ``shard_map``: each
rank keeps its queries and K/V block, and in CP rounds computes its queries against the block it holds while
``ppermute`` passes that block to the next rank (issued before the round's compute, so XLA can overlap the
transfer with the attention). The rounds' partial results are merged by their log-sum-exp (online softmax).
The mask compares positions and segment ids that travel with the K/V block, so the load-balanced order of
:mod:`jaxtron.parallel.context` stays exact. The backward is JAX's transpose of the rounds: dK/dV travel back
around the ring. Each round is rematerialized, so no round's score block is kept for the backward.

``ulysses`` (the rules name the exchange axis ``act_attn_head_exchange``): in the same ``shard_map``, an
all-to-all gives each rank the whole sequence of 1/CP of the heads, attention runs on it, and an all-to-all
returns the rank's own chunk of every head (:func:`ulysses`). Under ``all_gather`` the rules alone do the work
(K/V gathered by GSPMD), and :func:`sequence_attention` is plain attention. With a flash kernel
(``attention_impl=pallas``), :mod:`jaxtron.parallel.context_flash` runs each impl on the kernel instead.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxtron.parallel import context_flash
from jaxtron.parallel.sharding import constrain, current_context, logical_to_spec, mesh_axes_of

Q_NAMES = ("act_batch", "act_attn_seq", "act_attn_heads", "act_head_dim")
KV_NAMES = ("act_batch", "act_kv_seq", "act_attn_kv_heads", "act_head_dim")
ROW_NAMES = ("act_batch", "act_attn_seq")
_NEG = float(jnp.finfo(jnp.float32).min)


def _size(mesh, spec) -> int:
    n = 1
    for a in mesh_axes_of(spec, mesh):
        n *= mesh.shape[a]
    return n


def sequence_attention(q, k, v, segment_ids: Optional[jax.Array], positions: Optional[jax.Array],
                       scale: float, attend, flash=None):
    """Causal attention of q [b, s, h, d] over k, v [b, s, kvh, d] (positions and segment ids [b, s]);
    ``attend(q, k, v, segment_ids, scale, positions)`` is the attention of an unsplit sequence (the xla
    reference masks by position, so it also reads the load-balanced order); ``flash(q, k, v, q_seg, kv_seg,
    causal) -> (out, lse)`` a per-device kernel, which takes over when the sequence is split
    (:mod:`jaxtron.parallel.context_flash`). q, k and v are constrained to the attention names here, so the
    rules decide how the sequence is read."""
    ctx = current_context()
    if ctx is None or ctx[1] is None:
        return attend(q, k, v, segment_ids, scale, positions)
    rules, mesh = ctx
    # the axes as the arrays' specs resolve them: a name whose mesh axis an earlier name of the same array
    # took (act_kv_seq moved onto an axis of act_batch) leaves that dimension whole
    q_spec, kv_spec = logical_to_spec(Q_NAMES, rules), logical_to_spec(KV_NAMES, rules)
    ring_axes, q_axes = mesh_axes_of(kv_spec[1], mesh), mesh_axes_of(q_spec[1], mesh)
    # the heads are exchanged for the sequence only over axes that split the sequence
    exchange = tuple(a for a in mesh_axes_of(logical_to_spec(("act_attn_head_exchange",), rules)[0], mesh)
                     if a in ring_axes)
    split = _size(mesh, kv_spec[2]) * _size(mesh, exchange)
    if k.shape[2] % split:
        # ulysses with fewer kv heads than context x tensor: repeat each kv head for its query group (exact:
        # GQA with repeated K/V is the same attention), so every rank gets whole kv heads
        h, kvh = q.shape[2], k.shape[2]
        r = next(r for r in range(1, h // kvh + 1) if (h // kvh) % r == 0 and (kvh * r) % split == 0)
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    q = constrain(q, Q_NAMES)
    k, v = constrain(k, KV_NAMES), constrain(v, KV_NAMES)
    if ring_axes and ring_axes != q_axes:  # the ring pairs each rank's queries with its own K/V chunk
        if flash is not None:
            raise ValueError(f"attention: the rules split the queries' sequence over {q_axes} and K/V's over "
                             f"{ring_axes}; the flash kernels need both over the same axes, or K/V whole")
        return constrain(attend(q, k, v, segment_ids, scale, positions), Q_NAMES)  # as GSPMD partitions it
    if flash is not None and q_axes:
        return _flash_split(q, k, v, segment_ids, rules, mesh, q_axes, ring_axes, exchange, flash)
    if not ring_axes:
        return constrain(attend(q, k, v, segment_ids, scale, positions), Q_NAMES)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    spec = lambda names: logical_to_spec(names, rules)  # noqa: E731

    if exchange:
        def body(q, k, v, pos, seg):
            return ulysses(q, k, v, pos, seg, scale, exchange, attend)
    else:
        def body(q, k, v, pos, seg):
            return ring(q, k, v, pos, seg, scale, ring_axes, _size(mesh, ring_axes))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec(Q_NAMES), spec(KV_NAMES), spec(KV_NAMES),
                                                      spec(ROW_NAMES), spec(ROW_NAMES)),
                           out_specs=spec(Q_NAMES), check_vma=False)
    return mapped(q, k, v, positions, segment_ids)


def _flash_split(q, k, v, segment_ids, rules, mesh, q_axes, ring_axes, exchange, flash):
    """The kernel on a sequence split over ``q_axes``: K/V gathered, passed round or exchanged, as the rules
    say (:mod:`jaxtron.parallel.context_flash`)."""
    size = _size(mesh, q_axes)
    spec = lambda names: logical_to_spec(names, rules)  # noqa: E731
    kv_rows = ("act_batch", "act_kv_seq")
    has_seg = segment_ids is not None

    def body(q, k, v, *ids):
        seg, kv_seg = ids if has_seg else (None, None)
        if exchange:
            return context_flash.ulysses(q, k, v, seg, exchange, size, flash)
        if ring_axes:
            return context_flash.ring(q, k, v, seg, ring_axes, size, flash)
        return context_flash.gathered(q, k, v, seg, kv_seg, q_axes, size, flash)

    in_specs = (spec(Q_NAMES), spec(KV_NAMES), spec(KV_NAMES)) + ((spec(ROW_NAMES), spec(kv_rows)) if has_seg else ())
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec(Q_NAMES), check_vma=False)
    return mapped(q, k, v, *((segment_ids, segment_ids) if has_seg else ()))


def ulysses(q, k, v, pos, seg, scale: float, axes: tuple[str, ...], attend):
    """Per device (DeepSpeed-Ulysses): all-to-all from this rank's sequence chunk of every head to the whole
    sequence of 1/CP of the heads, attention, and back. Chunk j of the heads goes to rank j for q and for the
    kv heads alike, so each rank's query heads find their kv heads (GQA groups stay whole)."""
    to_heads = lambda x: jax.lax.all_to_all(x, axes, 2, 1, tiled=True)  # noqa: E731
    gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)  # noqa: E731
    out = attend(to_heads(q), to_heads(k), to_heads(v), gather(seg), scale, gather(pos))
    return jax.lax.all_to_all(out, axes, 1, 2, tiled=True)


# fp32 score bytes of one query tile against one K/V block: long sequences attend tile by tile, so a round's
# scores never exceed this (seq 131072 on context 8: 16384 x 16384 x 32 heads would be 32 GiB at once)
TILE_SCORE_BYTES = 1 << 30


def _query_tile(b: int, s: int, h: int, s_k: int) -> int:
    tile = s
    while b * h * tile * s_k * 4 > TILE_SCORE_BYTES and tile % 2 == 0:
        tile //= 2
    return tile


@jax.checkpoint
def _block_tile(q, k, v, q_pos, q_seg, k_pos, k_seg, scale):
    """Unnormalized output, row max and row sum of q's scores against one K/V block (fp32)."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    mask = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    mask = mask[:, None, None]
    scores = jnp.where(mask, scores, _NEG)  # before exp: exp of an unmasked overflow would NaN the gradient
    m = jax.lax.stop_gradient(jnp.max(scores, axis=-1))  # a shift: it cancels in the merged result
    p = jnp.where(mask, jnp.exp(scores - m[..., None]), 0.0)  # a row with no key here adds nothing
    o = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m, p.sum(-1)


def _block(q, k, v, q_pos, q_seg, k_pos, k_seg, scale):
    """One round, query tile by query tile (each rematerialized: the backward keeps no score block)."""
    b, s, h, d = q.shape
    tile = _query_tile(b, s, h, k.shape[1])
    if tile == s:
        return _block_tile(q, k, v, q_pos, q_seg, k_pos, k_seg, scale)
    n = s // tile
    tiles = lambda x: jnp.moveaxis(x.reshape(b, n, tile, *x.shape[2:]), 1, 0)  # noqa: E731
    o, m, l = jax.lax.map(lambda t: _block_tile(t[0], k, v, t[1], t[2], k_pos, k_seg, scale),
                          (tiles(q), tiles(q_pos), tiles(q_seg)))
    rows = lambda x: jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], s, *x.shape[5:])  # noqa: E731
    return rows(o), rows(m), rows(l)


def ring(q, k, v, pos, seg, scale: float, axes: tuple[str, ...], size: int):
    """Per device: q and one K/V block each; ``size`` rounds, the block passed on to the next rank."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    perm = [(i, (i + 1) % size) for i in range(size)]
    o = jnp.zeros((b, kvh, h // kvh, s, v.shape[-1]), jnp.float32)  # v may be narrower than q and k (MLA)
    m = jnp.full((b, kvh, h // kvh, s), _NEG, jnp.float32)
    l = jnp.zeros((b, kvh, h // kvh, s), jnp.float32)
    block = (k, v, pos, seg)
    for step in range(size):
        # Tie the block to the previous round's result: otherwise XLA's scheduler may run the whole chain of
        # transfers back to back before any attention (nothing depends on the attention), exposing them; tied,
        # each transfer starts after the previous round and runs beside this round's attention.
        block, o, m, l = jax.lax.optimization_barrier((block, o, m, l))
        nxt = jax.lax.ppermute(block, axes, perm) if step + 1 < size else None
        ob, mb, lb = _block(q, *block[:2], pos, seg, *block[2:], scale)
        new = jnp.maximum(m, mb)
        a, c = jnp.exp(m - new), jnp.exp(mb - new)
        o = o * a[..., None] + ob * c[..., None]
        l = l * a + lb * c
        m = new
        block = nxt
    out = o / l[..., None]  # every query attends at least to itself: l > 0
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, v.shape[-1]).astype(q.dtype)
