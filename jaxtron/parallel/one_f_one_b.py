"""The ``1f1b`` schedule: one forward and one backward per tick in one program (M + 2S - 2 ticks).

The loop is not differentiated: each tick a stage runs the forward of micro batch t - s and the backward of
micro batch t - (2S - 2 - s), applied to the cotangent from the next stage (the last stage differentiates the
loss after its layers, the first one the embedding before them); activations move forward and cotangents
backward with ``ppermute``, weight gradients accumulate in the carry. Activation memory is flat in M. Bubble
(S-1)/(M+S-1). The embedding and the loss run inside the loop, on the first and last stage, because the backward
of a micro batch starts as soon as its forward leaves the last stage.

By default a stage keeps the VJP residuals of the micro batches between their forward and backward in a ring of
2S - 1 slots (:func:`one_f_one_b_slots`, :func:`_kept_tick`); with ``parallel.pipeline_recompute=true`` it keeps
only their inputs (a ring of 2S) and runs ``jax.vjp`` of the stage again (:func:`_recomputing_tick`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxtron.parallel.pipeline_layout import (AXIS, PipelineSpec, chunked, in_stage_rules, layer_order, log_memory,
                                              nbytes, replicated, side_zeros, stage_shard_map, stage_specs,
                                              tree_index, unchunked)
from jaxtron.parallel.residuals import KeptVJP


def value_and_grad(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                 stacked: Any, stacked_specs: Any, shared: Any, micro: dict, accumulate: Callable,
                 make_tick: Callable | None = None):
    """:func:`jaxtron.parallel.pipeline.value_and_grad` under 1f1b: the tick loop in one ``shard_map``.
    ``make_tick(context) -> (tick, ring0)`` runs another schedule in the same loop (the same ticks, the
    activations and cotangents moving as here; :func:`jaxtron.parallel.zero_bubble.zb_h1_tick`); by default
    1f1b's. ``tick`` is one function for every tick, or a tuple of phases ``(first tick, end, function)``
    run as consecutive loops (a schedule whose ticks differ in what they may run)."""
    S = spec.stages
    chunks = chunked(stacked, stacked_specs, spec, mesh)
    mb0 = tree_index(micro, 0)
    x_aval = jax.eval_shape(pre, shared, mb0)
    aux_aval = jax.eval_shape(lambda: post(shared, jnp.zeros(x_aval.shape, x_aval.dtype), mb0)[1])
    tick_fn = make_tick or (_recomputing_tick if spec.recompute else _kept_tick)

    def body(chunks, shared, micro):
        local = jax.tree.map(lambda a: a[0, 0], chunks)                    # [Lc, ...]
        s = lax.axis_index(AXIS)
        zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
        zero_aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_aval)
        _, report0 = side_zeros(stage, local, zeros_x, tree_index(micro, 0), S)
        ctx = TickContext(spec, pre, stage, post, local, shared, micro, s, zeros_x, zero_aux, accumulate)
        tick, ring0 = tick_fn(ctx)
        grads0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), (local, shared))
        carry = (zeros_x, zeros_x, ring0, grads0, (zero_aux, report0))
        for start, stop, fn in (tick if isinstance(tick, tuple) else ((0, spec.ticks, tick),)):
            carry, _ = lax.scan(fn, carry, jnp.arange(start, stop))
        _, _, _, (g_local, g_shared), sums = carry
        g_shared = lax.psum(g_shared, AXIS)   # embedding grads live on the first stage, head grads on the last
        sums = lax.psum(sums, AXIS)           # the loss's sums from the last stage, each stage's own report
        return jax.tree.map(lambda g: g[None, None], g_local), g_shared, sums

    fn = stage_shard_map(in_stage_rules(body, rules), mesh,
                    (stage_specs(chunks), replicated(shared), replicated(micro)),
                    (stage_specs(chunks), replicated(shared), P()))
    g_chunks, g_shared, (sums, report) = fn(chunks, shared, micro)
    return (sums, layer_order(report)), (unchunked(g_chunks, spec), g_shared)


@dataclass(frozen=True)
class TickContext:
    """What a 1f1b tick closes over, inside the shard_map body (``s``: this device's stage index)."""
    spec: PipelineSpec
    pre: Callable
    stage: Callable
    post: Callable
    local: Any
    shared: Any
    micro: dict
    s: Any
    zeros_x: jax.Array
    zero_aux: Any
    accumulate: Callable

    def add_grads(self, grads, d):
        return self.accumulate(grads, jax.tree.map(lambda g, x: x.astype(g.dtype), grads, d))

    def output_cotangent(self, is_last, y, mb, bwd_in):
        """(dy, the head's gradient to the shared leaves, loss aux) for this tick's backward: the last stage's
        starts at the loss, on its own forward of this tick; the others take the cotangent the next stage sent."""
        def head():
            loss, pull, aux = jax.vjp(lambda sh, y: self.post(sh, y, mb), self.shared, y, has_aux=True)
            d_shared, dy = pull(jnp.ones((), loss.dtype))
            return dy, d_shared, aux

        def from_next():
            return bwd_in, jax.tree.map(jnp.zeros_like, self.shared), self.zero_aux

        return lax.cond(is_last, head, from_next)

    def send(self, y, dx):
        """Activations one stage on, cotangents one stage back (the ends send nothing)."""
        S = self.spec.stages
        return (lax.ppermute(y, AXIS, [(j, j + 1) for j in range(S - 1)]),
                lax.ppermute(dx, AXIS, [(j, j - 1) for j in range(1, S)]))


def one_f_one_b_slots(stages: int) -> int:
    """Ring slots for the micro batches a stage holds between its forward and backward under 1f1b: stage s runs
    the forward of micro batch m at tick m + s and its backward at tick m + 2S - 2 - s, so it holds
    2(S - 1 - s) + 1 micro batches (the one written this tick included); stage 0 holds the most, 2S - 1. (In
    Megatron's 1F1B, whose ticks are one forward or one backward, stage 0 holds S: here a tick runs both, so a
    micro batch's round trip through the stages takes 2S - 2 ticks of one forward each.)"""
    return 2 * stages - 1


def _kept_tick(c: TickContext):
    """The 1f1b tick that keeps the stage's VJP residuals: each forward tick runs ``jax.vjp`` of the embedding (on
    the first stage) and the stage's layers and keeps the residuals that depend on the micro batch in a ring
    slot; the backward tick applies them to the cotangent (the last stage first differentiates the post, on
    the output of its forward in the same tick). No stage forward runs twice."""
    S, M = c.spec.stages, c.spec.micro_batches
    R = one_f_one_b_slots(S)
    is_first, is_last = c.s == 0, c.s == S - 1

    def f(params, x_in, m, _select):
        """The stage's part before the loss: ((output, objective term), report)."""
        local, shared = params
        mb = tree_index(c.micro, m)
        x0 = lax.cond(is_first, lambda: c.pre(shared, mb), lambda: x_in)
        y, (obj, report) = c.stage(local, x0, mb)
        return (y, obj), report

    params = (c.local, c.shared)
    kept = KeptVJP(f, params, c.zeros_x, jnp.zeros((), jnp.int32))
    obj_dtype = jax.eval_shape(f, params, c.zeros_x, 0, ())[0][1].dtype
    log_memory(c.spec, R, kept.kept_bytes(), "the stage's VJP residuals")
    ring0 = tuple(jnp.zeros((R,) + a.shape, a.dtype) for a in kept.kept_shapes)

    def tick(carry, t):
        fwd_in, bwd_in, ring, grads, (sums, report) = carry
        m_f = t - c.s
        valid_f = (m_f >= 0) & (m_f < M)
        mf = jnp.clip(m_f, 0, M - 1)

        def forward():
            (y, _), rep, res = kept.forward(params, fwd_in, mf)
            return y, rep, res

        def skip_forward():
            return c.zeros_x, jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), report), \
                tuple(jnp.zeros(a.shape, a.dtype) for a in kept.kept_shapes)

        y, rep, res = lax.cond(valid_f, forward, skip_forward)
        report = jax.tree.map(lambda r, a: r.at[c.s].add(a), report, rep)
        # Slot m_f mod R, m_f unclipped: outside [0, M) it holds no live micro batch (before this stage's first
        # forward, or after micro batch m_f - R, whose backward ran 2S - 2 - 2s < R ticks after its forward), so
        # the zeros a skipped tick writes there are harmless and no select over the slot is needed.
        slot_f = jnp.mod(m_f, R)
        ring = tuple(lax.dynamic_update_index_in_dim(r, a, slot_f, 0) for r, a in zip(ring, res))

        m_b = t - (2 * S - 2 - c.s)
        valid_b = (m_b >= 0) & (m_b < M)
        mb_i = jnp.clip(m_b, 0, M - 1)

        def backward(grads, sums):
            mb = tree_index(c.micro, mb_i)
            dy, d_post, aux = c.output_cotangent(is_last, y, mb, bwd_in)
            slot = tuple(lax.dynamic_index_in_dim(r, jnp.mod(mb_i, R), 0, keepdims=False) for r in ring)
            (d_local, d_shared), dx = kept.backward(params, slot, mb_i, (dy, jnp.ones((), obj_dtype)))
            d_shared = jax.tree.map(jnp.add, d_shared, d_post)
            grads = c.add_grads(grads, (d_local, d_shared))
            return grads, jax.tree.map(jnp.add, sums, aux), dx

        grads, sums, dx = lax.cond(valid_b, backward, lambda g, a: (g, a, c.zeros_x), grads, sums)
        fwd_next, bwd_next = c.send(y, dx)
        return (fwd_next, bwd_next, ring, grads, (sums, report)), None

    # One loop, each tick compiling both halves. Phases (zero_bubble.tick_phases) would drop the backward from
    # the fill ticks and the forward from the drain ticks, but every loop after the first then needs its own
    # copy of what the loops share (XLA copies a while loop's operand that is still live after it): measured by
    # the planner on Llama-3-70B, tensor 8 x stage 2 x fsdp 4 with the stage's weights gathered once, temp memory
    # +8.5 GB and collectives overlapped 4.6 -> 0.6 s, 732 -> 634 tokens/s/GPU (tensor 8 x stage 8: 711 -> 737).
    return tick, ring0


def _recomputing_tick(c: TickContext):
    """The 1f1b tick of ``parallel.pipeline_recompute``: a forward tick keeps only the stage's input (a ring of 2S
    slots), the backward tick runs ``jax.vjp`` of the stage on it again. The least activation memory, one
    stage forward more per micro batch."""
    S, M = c.spec.stages, c.spec.micro_batches
    R = 2 * S  # a stage holds at most 2(S-1-s)+1 inputs between their forward and backward
    is_first, is_last = c.s == 0, c.s == S - 1
    ring0 = jnp.zeros((R,) + c.zeros_x.shape, c.zeros_x.dtype)
    log_memory(c.spec, R, nbytes(c.zeros_x), "the stage inputs (and one micro batch's residuals while its "
                "backward runs)")

    def f(params, x_in, m):
        """This stage's part of micro batch m: ((output, loss), (aux, report)); the loss is the stage's objective
        term, plus the post's loss on the last stage."""
        local, shared = params
        mb = tree_index(c.micro, m)
        x0 = lax.cond(is_first, lambda: c.pre(shared, mb), lambda: x_in)
        y, (obj, report) = c.stage(local, x0, mb)
        loss, aux = lax.cond(is_last, lambda: c.post(shared, y, mb),
                             lambda: (jnp.zeros((), jnp.float32), c.zero_aux))
        return (y, loss + obj), (aux, report)

    def tick(carry, t):
        fwd_in, bwd_in, ring, grads, (sums, report) = carry
        m_f = t - c.s
        valid_f = (m_f >= 0) & (m_f < M)
        mf = jnp.clip(m_f, 0, M - 1)
        ring = ring.at[mf % R].set(jnp.where(valid_f, fwd_in, ring[mf % R]))
        # The last stage's forward is recomputed by its backward in this same tick.
        y = lax.cond(valid_f & ~is_last, lambda: f((c.local, c.shared), fwd_in, mf)[0][0], lambda: c.zeros_x)

        m_b = t - (2 * S - 2 - c.s)
        valid_b = (m_b >= 0) & (m_b < M)
        mb_i = jnp.clip(m_b, 0, M - 1)

        def backward(grads, sums):
            (_, loss), vjp, (aux, rep) = jax.vjp(lambda p, x: f(p, x, mb_i), (c.local, c.shared),
                                                 ring[mb_i % R], has_aux=True)
            dy = jnp.where(is_last, jnp.zeros_like(bwd_in), bwd_in)
            dparams, dx = vjp((dy, jnp.ones((), loss.dtype)))
            grads = c.add_grads(grads, dparams)
            report = jax.tree.map(lambda r, a: r.at[c.s].add(a), sums[1], rep)
            return grads, (jax.tree.map(jnp.add, sums[0], aux), report), dx

        grads, sums, dx = lax.cond(valid_b, backward, lambda g, a: (g, a, c.zeros_x), grads, (sums, report))
        fwd_next, bwd_next = c.send(y, dx)
        return (fwd_next, bwd_next, ring, grads, sums), None

    return tick, ring0
