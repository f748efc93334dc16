"""The fill-drain schedules, ``gpipe`` and ``circular``: a tick loop over the stages, differentiated.

* ``gpipe``: fill-drain over M + S - 1 ticks; the loop's backward runs its ticks in reverse. Bubble
  (S-1)/(M+S-1).
* ``circular``: each device holds V non-adjacent chunks (device s runs chunks s, s+S, ...; Megatron's virtual
  pipeline, MaxText's circular pipeline); micro batches loop around the ring V times over V*M + S - 1 ticks.
  Bubble (S-1)/(V*M+S-1). The stacked weights are stored in layer order, contiguous per stage, so the step
  regroups them (one all-to-all of the layer weights, and of their gradients, per step).

No stage forward runs twice by default: the loop keeps each tick's VJP residuals (V*M + S - 1 of them) and its
backward is written out (:func:`_kept_loop`: the ticks in reverse, each applying its residuals). With
``parallel.pipeline_recompute=true`` the loop is differentiated by autodiff instead, each tick under
``jax.checkpoint``, keeping only the stage input per tick.

The embedding runs before the pipelined region and the loss after it, spread over the stages (micro batches
split over ``stage`` when S divides M); the loss head's gradient is taken in the same loop as its value (a
custom VJP, :func:`post_loss`), so the head runs once per micro batch and the step holds no loop of collectives
that is independent of the backward: XLA:CPU runs independent regions concurrently, each blocked collective
holding one of a few pool threads, and two such loops plus the weight all-gathers deadlocked 8 CPU devices
(tests/test_pipeline.py runs that command).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxtron.parallel.pipeline_layout import (AXIS, PipelineSpec, in_stage_rules, layer_order, log_memory, nbytes,
                                              replicated, side_zeros, stage_shard_map, stage_specs, tree_index)
from jaxtron.parallel.residuals import KeptVJP


def cast_to(tree: Any, dtypes: Any) -> Any:
    """``tree`` with each leaf cast to the dtype at its place in ``dtypes`` (a tree of the same structure; a
    leaf's own dtype keeps it); ``dtypes`` None: ``tree`` as it is."""
    return tree if dtypes is None else jax.tree.map(lambda a, d: a.astype(d), tree, dtypes)


def _kept_loop(spec: PipelineSpec, rules, stage: Callable, act_dtype, local: Any, x0: jax.Array, micro: dict,
               no_side: Any, report0: Any, local_dtypes: Any = None) -> Callable:
    """The gpipe/circular tick loop of one device, ``loop(local, xs, micro, s) -> (outs, obj, report)``, with a
    backward written out: its forward keeps each tick's micro-batch-dependent VJP residuals (:class:`KeptVJP`,
    stacked over ticks) and the backward runs the ticks in reverse, applying them (no stage forward runs
    twice). Autodiff of the loop would not: a tick's ``lax.cond`` (fill and drain ticks skip the stage) and
    circular's tick-dependent chunk index make the weights' casts residuals of every tick; here the weights
    are one residual of the whole loop and the chunk index is a ``select`` whose weight residuals are made
    again in the backward.

    ``local_dtypes`` (``train.cast_params_once``: the compute dtype of each leaf the model casts at use): the
    forward and the backward each cast the stage's weights once, before their tick loop, instead of in every
    tick; each tick's gradient of the cast copy is converted to the weight's dtype before the sum over ticks,
    as the per-use cast's transpose does, so the numbers are the per-use cast's."""
    S, M, V, T = spec.stages, spec.micro_batches, spec.chunks_per_device, spec.ticks
    ring = [(j, (j + 1) % S) for j in range(S)]
    back_ring = [((j + 1) % S, j) for j in range(S)]

    def chunk(local, x, index, v):
        m, micro = index
        y, (obj, report) = stage(tree_index(local, v), x.astype(act_dtype), tree_index(micro, m))
        return (y.astype(x.dtype), obj), report

    i0 = jnp.zeros((), jnp.int32)
    kept = KeptVJP(chunk, cast_to(local, local_dtypes), x0, (i0, micro), i0)
    no_res = lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in kept.kept_shapes)

    def where_tick(t, s):
        i = t - s
        valid = (i >= 0) & (i < V * M)
        ic = jnp.clip(i, 0, V * M - 1)
        return valid, ic // M, ic % M

    def where_back(t, s):
        """Stage 0 keeps what the last stage sends back until that micro batch's next round."""
        il = t - (S - 1)
        return (s == 0) & (il >= 0) & (il < (V - 1) * M), jnp.clip(il, 0, V * M - 1) % M

    def forward(local, xs, micro, s):
        local = cast_to(local, local_dtypes)  # once for all the ticks (the per-use casts: in each)

        def tick(carry, t):
            cur, loop_buf, outs, obj, report = carry
            valid, v, m = where_tick(t, s)
            first = xs[m] if V == 1 else jnp.where(v == 0, xs[m], loop_buf[m])
            x_in = jnp.where(s == 0, first, cur)

            def go():
                (y, obj_t), rep, res = kept.forward(local, x_in, (m, micro), v)
                return (y, (obj_t, rep)), res
            (y, (obj_t, report_t)), res = lax.cond(valid, go, lambda: ((x_in, no_side), no_res()))
            obj = obj + obj_t
            report = jax.tree.map(lambda r, a: r.at[v * S + s].add(a), report, report_t)
            done = valid & (s == S - 1) & (v == V - 1)
            outs = outs.at[m].set(jnp.where(done, y, outs[m]))
            nxt = lax.ppermute(y, AXIS, ring)
            if V > 1:
                back, ml = where_back(t, s)
                loop_buf = loop_buf.at[ml].set(jnp.where(back, nxt, loop_buf[ml]))
            return (nxt, loop_buf, outs, obj, report), res

        zeros = jnp.zeros_like(xs[0])
        carry = (zeros, jnp.zeros_like(xs) if V > 1 else None, jnp.zeros_like(xs), no_side[0], report0)
        (_, _, outs, obj, report), res = lax.scan(tick, carry, jnp.arange(T))
        return (outs, obj, report), res

    @jax.custom_vjp
    def loop(local, xs, micro, s):
        return forward(local, xs, micro, s)[0]

    def fwd(local, xs, micro, s):
        out, res = forward(local, xs, micro, s)
        return out, (local, micro, s, res)

    @functools.partial(in_stage_rules, rules=rules)  # traced when the step is transposed, outside the body's
    def bwd(saved, cts):                                 # rules: the stage must trace as in the forward
        """The forward's ticks transposed, last tick first: the loop buffer's and ppermute's transposes, the
        output slot's cotangent, the stage's VJP from the kept residuals, and the input select's transpose."""
        weights, micro, s, res = saved
        local = cast_to(weights, local_dtypes)
        ct_outs, ct_obj, _ = cts   # the report has no gradient (forward_loss stops it)

        def rtick(carry, inp):
            t, res_t = inp
            ct_nxt, ct_loop_buf, d_local, d_xs = carry
            valid, v, m = where_tick(t, s)
            if V > 1:
                back, ml = where_back(t, s)
                ct_nxt = ct_nxt + jnp.where(back, ct_loop_buf[ml], 0)
                ct_loop_buf = ct_loop_buf.at[ml].set(jnp.where(back, 0, ct_loop_buf[ml]))
            ct_y = lax.ppermute(ct_nxt, AXIS, back_ring)
            done = valid & (s == S - 1) & (v == V - 1)
            ct_y = ct_y + jnp.where(done, ct_outs[m], 0)
            d_l, ct_x = lax.cond(valid, lambda: kept.backward(local, res_t, (m, micro), (ct_y, ct_obj), v),
                                 lambda: (jax.tree.map(jnp.zeros_like, local), ct_y))   # skipped: y = x_in
            # each tick's gradient of the cast copy in the weights' dtype before the sum (fp32 master weights)
            d_local = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), d_local, d_l)
            ct_first = jnp.where(s == 0, ct_x, 0)
            ct_cur = jnp.where(s == 0, 0, ct_x)
            if V > 1:
                d_xs = d_xs.at[m].add(jnp.where(v == 0, ct_first, 0))
                ct_loop_buf = ct_loop_buf.at[m].add(jnp.where(v == 0, 0, ct_first))
            else:
                d_xs = d_xs.at[m].add(ct_first)
            return (ct_cur, ct_loop_buf, d_local, d_xs), None

        zeros = jnp.zeros_like(ct_outs[0])
        carry = (zeros, jnp.zeros_like(ct_outs) if V > 1 else None, jax.tree.map(jnp.zeros_like, weights),
                 jnp.zeros_like(ct_outs))
        (_, _, d_local, d_xs), _ = lax.scan(rtick, carry, (jnp.arange(T), res), reverse=True)
        return d_local, d_xs, None, None

    loop.defvjp(fwd, bwd)
    return loop, kept


def forward_outputs(spec: PipelineSpec, mesh: Mesh, rules, stage: Callable, chunks: Any, xs: jax.Array,
                     micro: dict, act_dtype, log_kept: bool, chunk_dtypes: Any = None):
    """Run the stage loop on embedded micro batches xs [M, mb, seq, d]: the last chunk's outputs [M, ...],
    split over ``stage`` along M when S divides M (else replicated), the sum of the stages' objective terms
    and their per-layer reports summed over micro batches (layer order). ``chunk_dtypes``: see
    :func:`_kept_loop` (the loop that keeps residuals casts the weights once; the recomputing loop, which
    autodiff differentiates, would sum a cast copy's gradients over ticks in bf16: it casts per use)."""
    S, M, V = spec.stages, spec.micro_batches, spec.chunks_per_device
    split_out = M % S == 0

    @jax.checkpoint
    def recomputed_chunk(local, v, x, m, valid, no_side):
        """One tick of one stage under ``parallel.pipeline_recompute``, rematerialized (the backward keeps only
        the stage input per tick). Fill and drain ticks skip the stage: the cond sits inside the checkpoint, so
        its operands (the stage weights) are not residuals of every tick (measured: no change in temp memory at
        M = 64)."""
        def run():
            y, side = stage(tree_index(local, v), x.astype(act_dtype), tree_index(micro, m))
            return y.astype(x.dtype), side
        return lax.cond(valid, run, lambda: (x, no_side))

    def body(chunks, xs, micro_in):
        local = jax.tree.map(lambda a: a[0], chunks)                     # [V, Lc, ...]
        s = lax.axis_index(AXIS)
        ring = [(j, (j + 1) % S) for j in range(S)]
        no_side, report0 = side_zeros(stage, tree_index(local, 0), xs[0].astype(act_dtype), tree_index(micro, 0),
                                      S * V)
        if not spec.recompute:
            loop, kept = _kept_loop(spec, rules, stage, act_dtype, local, xs[0], micro_in, no_side, report0,
                                    chunk_dtypes)
            if log_kept:
                log_memory(spec, spec.ticks, kept.kept_bytes(), "the stage's VJP residuals (every tick's)")
            return _gathered(*loop(local, xs, micro_in, s))
        run_chunk = recomputed_chunk
        if log_kept:
            log_memory(spec, spec.ticks, nbytes(xs[0]), "the stage inputs (every tick's)")

        def tick(carry, t):
            cur, loop_buf, outs, obj, report = carry
            i = t - s
            valid = (i >= 0) & (i < V * M)
            ic = jnp.clip(i, 0, V * M - 1)
            v, m = ic // M, ic % M
            first = xs[m] if V == 1 else jnp.where(v == 0, xs[m], loop_buf[m])
            x_in = jnp.where(s == 0, first, cur)
            y, (obj_t, report_t) = run_chunk(local, v, x_in, m, valid, no_side)
            obj = obj + obj_t
            report = jax.tree.map(lambda r, a: r.at[v * S + s].add(a), report, report_t)
            done = valid & (s == S - 1) & (v == V - 1)
            outs = outs.at[m].set(jnp.where(done, y, outs[m]))
            nxt = lax.ppermute(y, AXIS, ring)
            if V > 1:  # stage 0 keeps what the last stage sends back until that micro batch's next repeat
                il = t - (S - 1)
                back = (s == 0) & (il >= 0) & (il < (V - 1) * M)
                ml = jnp.clip(il, 0, V * M - 1) % M
                loop_buf = loop_buf.at[ml].set(jnp.where(back, nxt, loop_buf[ml]))
            return (nxt, loop_buf, outs, obj, report), None

        zeros = jnp.zeros_like(xs[0])
        carry = (zeros, jnp.zeros_like(xs) if V > 1 else None, jnp.zeros_like(xs), no_side[0], report0)
        (_, _, outs, obj, report), _ = lax.scan(tick, carry, jnp.arange(spec.ticks))
        return _gathered(outs, obj, report)

    def _gathered(outs, obj, report):
        s = lax.axis_index(AXIS)
        outs = jnp.where(s == S - 1, outs, jnp.zeros_like(outs))
        obj, report = lax.psum((obj, report), AXIS)   # each stage holds the terms of its own chunks
        if split_out:
            return lax.psum_scatter(outs, AXIS, scatter_dimension=0, tiled=True), obj, report
        return lax.psum(outs, AXIS), obj, report

    fn = stage_shard_map(in_stage_rules(body, rules), mesh, (stage_specs(chunks), P(), replicated(micro)),
                    (P(AXIS) if split_out else P(), P(), P()))
    outs, obj, report = fn(chunks, xs, micro)
    return outs, obj, layer_order(report)


def _over_micro(spec: PipelineSpec, fn: Callable, shared: Any, xs: Any, micro: dict, carry0: Any):
    """Scan ``fn(shared, xs[m], micro[m]) -> (sums, per_m)`` over micro batches: (summed ``sums``, stacked
    ``per_m`` [M, ...]). When S divides M the stages work on different micro batches at once (vmap sharded
    over ``stage``) and ``sums`` keep a leading [S] axis until one reduction after the loop."""
    S, M = spec.stages, spec.micro_batches
    if M % S:
        def body(acc, xm):
            sums, per_m = fn(shared, *xm)
            return jax.tree.map(jnp.add, acc, sums), per_m
        return lax.scan(body, carry0(()), (xs, micro))
    # [M] (split over stage in S contiguous blocks) -> [M/S, S]: step r works on micro batch j*M/S + r on stage j
    regroup = lambda a: a.reshape(S, M // S, *a.shape[1:]).swapaxes(0, 1)
    group = jax.vmap(fn, in_axes=(None, 0, 0), spmd_axis_name=AXIS)

    def body(acc, xm):
        sums, per_m = group(shared, *xm)
        return jax.tree.map(jnp.add, acc, sums), per_m

    sums, per_m = lax.scan(body, carry0((S,)), jax.tree.map(regroup, (xs, micro)))
    ungroup = lambda a: a.swapaxes(0, 1).reshape(M, *a.shape[2:])
    return jax.tree.map(lambda a: a.sum(0), sums), jax.tree.map(ungroup, per_m)


def _zeros_like_out(fn: Callable, *args) -> Callable:
    out = jax.eval_shape(fn, *args)
    return lambda lead: jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), out)


def post_loss(spec: PipelineSpec, post: Callable, shared: Any, outs: jax.Array, micro: dict,
              shared_dtypes: Any = None):
    """(loss, aux) summed over micro batches. Its VJP is computed in the forward, in the same loop as the loss
    (one pass of the head per micro batch instead of a forward and a rematerialized one), which also leaves
    no second loop of collectives independent of the backward. ``aux`` is for reporting: it has no gradient.
    ``shared_dtypes``: cast the head's weights once, before the loop (each micro batch's gradient of the cast
    copy goes to fp32 before the sum, as with the per-use casts)."""
    mb0 = tree_index((outs, micro), 0)
    dtypes = jax.tree.map(lambda p: p.dtype, shared)

    def value(shared, x, mb):
        return post(shared, x, mb), None

    def value_and_grad(shared, x, mb):
        (loss, aux), (d_shared, dx) = jax.value_and_grad(post, argnums=(0, 1), has_aux=True)(shared, x, mb)
        d_shared = jax.tree.map(lambda g: g.astype(jnp.float32), d_shared)
        return ((loss, aux), d_shared), dx

    @jax.custom_vjp
    def total(shared, outs):
        shared = cast_to(shared, shared_dtypes)
        return _over_micro(spec, value, shared, outs, micro, _zeros_like_out(post, shared, *mb0))[0]

    def fwd(shared, outs):
        shared = cast_to(shared, shared_dtypes)
        (sums, d_shared), d_outs = _over_micro(spec, value_and_grad, shared, outs, micro,
                                               _zeros_like_out(lambda *a: value_and_grad(*a)[0], shared, *mb0))
        return sums, (d_shared, d_outs)

    def bwd(res, ct):
        d_shared, d_outs = res
        g = ct[0]
        return (jax.tree.map(lambda d, t: (d * g).astype(t), d_shared, dtypes),
                (d_outs * g.astype(d_outs.dtype)))

    total.defvjp(fwd, bwd)
    return total(shared, outs)

