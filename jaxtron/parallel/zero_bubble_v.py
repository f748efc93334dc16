"""The ``zbv`` schedule (ZB-V, Qi et al. 2024): two chunks of the layers per device in a V, each chunk's backward
split into B (to its input) and W (to its weights), run from :func:`jaxtron.parallel.zero_bubble_v_table.zbv_table`
in one ``shard_map`` manual over ``stage`` and one ``lax.scan`` over its ticks.

A tick runs one op per device: F of a chunk (``jax.vjp`` of its layers, the residuals kept in a ring slot;
device 0's chunk 0 starts with the embedding, its chunk 1 ends in the loss, whose cotangent is taken in the
same tick), B (the input part of the kept pullback, split at its jaxpr by
:class:`~jaxtron.parallel.backward_split.SplitBackward`: the chunk's input cotangent, and a stash of what W
reads, the layers' output cotangents and the activations their weight dots take) or W (the weight part, from
the residuals, the output cotangent and the stash: no input-cotangent chain run again). The op's output is
sent both ways (``ppermute`` to d + 1 and to d - 1) and kept for the device itself: the table says which
receiver keeps it and in which slot of the activation-shaped buffer ring (inputs waiting for their F, output
cotangents waiting for their B and W).

Costs, honestly. A (chunk, micro batch) slot holds its residuals from F to W and its stash from B to W. Each
tick moves two activation-sized buffers (one each way), of which at most one is needed: about 6M ticks move
what 1f1b's M + 2S - 2 ticks move twice each, about 6x 1f1b's stage-to-stage bytes. Under FSDP without
``parallel.pipeline_fsdp_gather_once`` each of F, B and W gathers its chunk's weights.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxtron.parallel.pipeline_layout import (AXIS, PipelineSpec, chunked, in_stage_rules, layer_order, log_memory,
                                              nbytes, replicated, side_zeros, stage_shard_map, stage_specs,
                                              tree_index, unchunked)
from jaxtron.parallel.residuals import KeptVJP
from jaxtron.parallel.zero_bubble_v_table import BWD, FWD, IDLE, LEFT, RIGHT, SELF, WGT, zbv_arrays, zbv_table


def zeros(shapes: Any, lead: tuple = ()) -> Any:
    """Zeros of each ``jax.ShapeDtypeStruct`` in ``shapes``, with leading dimensions ``lead`` (a ring's slots)."""
    return jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), shapes)


def slot_of(ring: Any, i) -> Any:
    """Slot ``i`` of every array of a ring."""
    return jax.tree.map(lambda r: lax.dynamic_index_in_dim(r, i, 0, keepdims=False), ring)


def put(buf: jax.Array, i, x: jax.Array, scratch: int) -> jax.Array:
    """``buf[i] = x`` where i >= 0; a dropped value goes to the scratch slot, so the write never reads back."""
    return lax.dynamic_update_index_in_dim(buf, x, jnp.where(i >= 0, i, scratch), 0)


def value_and_grad(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                   stacked: Any, stacked_specs: Any, shared: Any, micro: dict, accumulate: Callable):
    """:func:`jaxtron.parallel.pipeline.value_and_grad` under zbv (``stacked`` and ``shared`` already cast, as
    for 1f1b; gradients come back in fp32)."""
    S = spec.stages
    table = zbv_table(S, spec.micro_batches)
    arrays = zbv_arrays(table)
    chunks = chunked(stacked, stacked_specs, spec, mesh)             # [S, 2, Lc, ...]
    mb0 = tree_index(micro, 0)
    x_aval = jax.eval_shape(pre, shared, mb0)
    aux_aval = jax.eval_shape(lambda: post(shared, jnp.zeros(x_aval.shape, x_aval.dtype), mb0)[1])
    at = {k: jnp.asarray(getattr(arrays, k)) for k in ("op", "chunk", "micro", "res_slot", "buf_slot",
                                                       "head_slot", "recv")}

    def body(chunks, shared, micro):
        local = jax.tree.map(lambda a: a[0], chunks)                   # [2, Lc, ...]: chunks d and 2S - 1 - d
        s = lax.axis_index(AXIS)
        is_first = s == 0
        zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
        zero_aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_aval)
        _, report0 = side_zeros(stage, tree_index(local, 0), zeros_x, tree_index(micro, 0), 2 * S)

        def f(params, x_in, m, c):
            """Chunk c's part of micro batch m: ((output, objective term), report). Device 0's chunk 0 starts
            from the embedding (a select, not a cond: see zero_bubble.zb_h1_tick)."""
            local, shared = params
            mb = tree_index(micro, m)
            x0 = jnp.where(is_first & (c == 0), pre(shared, mb), x_in)
            y, (obj, report) = stage(tree_index(local, c), x0, mb)
            return (y, obj), report

        params = (local, shared)
        zero_i = jnp.zeros((), jnp.int32)
        kept = KeptVJP(f, params, zeros_x, zero_i, zero_i)
        obj_one = jnp.ones((), jax.eval_shape(f, params, zeros_x, 0, 0)[0][1].dtype)
        split = kept.split(params, zero_i, zero_i)
        log_memory(spec, arrays.res_slots, kept.kept_bytes() + nbytes(split.stash_shapes),
                   f"the VJP residuals and what W reads from B (and {arrays.buf_slots} buffers of inputs and "
                   f"cotangents, {arrays.buf_slots * nbytes(zeros_x) / 2 ** 20:.2f} MiB)",
                   "(chunk, micro batch) pairs (a chunk: half a stage's layers)")
        # a (chunk, micro batch)'s residuals from its F, and what its W reads from its B (the stash), in one slot;
        # one more slot in each ring and buffer takes the writes of the ticks that keep nothing there, so that
        # a write never has to read the slot back to leave it unchanged
        scratch_res, scratch_buf = arrays.res_slots, arrays.buf_slots
        ring0 = (tuple(zeros(kept.kept_shapes, (scratch_res + 1,))), zeros(split.stash_shapes, (scratch_res + 1,)))
        buf0 = jnp.zeros((scratch_buf + 1,) + zeros_x.shape, zeros_x.dtype)
        grads0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), params)

        def add_grads(grads, d):
            return accumulate(grads, jax.tree.map(lambda g, x: x.astype(g.dtype), grads, d))

        def tick(carry, t):
            (from_left, from_right, own), buf, (ring, stashes), grads, (sums, report) = carry
            for src, x in ((LEFT, from_left), (RIGHT, from_right), (SELF, own)):
                buf = put(buf, at["recv"][t, s, src], x, scratch_buf)
            op, c, m = at["op"][t, s], at["chunk"][t, s], jnp.maximum(at["micro"][t, s], 0)
            rs, bs = jnp.maximum(at["res_slot"][t, s], 0), jnp.maximum(at["buf_slot"][t, s], 0)
            x_in, dy_in = buf[bs], (buf[bs], obj_one)
            no_rep = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), report)
            no_res, no_stash = tuple(zeros(kept.kept_shapes)), zeros(split.stash_shapes)

            # One op per device and tick, one switch: (grads, sums) -> (grads, sums, output, F's residuals, report,
            # B's stash, the loss's cotangent); a device runs one branch, the others' outputs are zeros.
            def idle(grads, sums):
                return grads, sums, zeros_x, no_res, no_rep, no_stash, zeros_x

            def forward(grads, sums):
                (y, _), rep, res = kept.forward(params, x_in, m, c)
                return grads, sums, y, res, rep, no_stash, zeros_x

            def forward_and_loss(grads, sums):
                """Device 0's chunk 1 ends in the loss: its cotangent, and the head's own gradient."""
                grads, sums, y, res, rep, _, _ = forward(grads, sums)
                mb = tree_index(micro, m)
                loss, pull, aux = jax.vjp(lambda sh, y: post(sh, y, mb), shared, y, has_aux=True)
                d_shared, dy = pull(jnp.ones((), loss.dtype))
                grads = add_grads(grads, (jax.tree.map(jnp.zeros_like, local), d_shared))
                return grads, jax.tree.map(jnp.add, sums, aux), y, res, rep, no_stash, dy

            def input_grad(grads, sums):
                """B: the input part of the kept pullback, and the weight gradients its equations make anyway;
                what W reads of B's values (the layers' output cotangents, the activations their weight dots
                read) goes into the slot's stash."""
                dx, early, stash = split.input_part(params, slot_of(ring, rs), m, dy_in, c)
                return add_grads(grads, early), sums, dx, no_res, no_rep, stash, zeros_x

            def weight_grad(grads, sums):
                """W: the weight part, from the residuals, the output cotangent and the stash."""
                d_params = split.weight_part(params, slot_of(ring, rs), m, dy_in, c, slot_of(stashes, rs))
                return add_grads(grads, d_params), sums, zeros_x, no_res, no_rep, no_stash, zeros_x

            head = at["head_slot"][t, s]
            branches = {IDLE: idle, FWD: forward, BWD: input_grad, WGT: weight_grad}
            branches = [branches[k] for k in sorted(branches)] + [forward_and_loss]
            branch = jnp.where((op == FWD) & (head >= 0), len(branches) - 1, op)
            grads, sums, out, res, rep, stash, dy = lax.switch(branch, branches, grads, sums)
            # the report of the chunk's layers, in layer order: device d's chunk 1 is the V's chunk 2S - 1 - d
            report = jax.tree.map(lambda r, a: r.at[jnp.where(c == 0, s, 2 * S - 1 - s)].add(a), report, rep)
            def keep(kind):   # the op's new value into its slot where the op is of that kind, else to scratch
                return lambda r, a: lax.dynamic_update_index_in_dim(r, a, jnp.where(op == kind, rs, scratch_res), 0)

            ring = tuple(map(keep(FWD), ring, res))
            stashes = jax.tree.map(keep(BWD), stashes, stash)
            buf = put(buf, head, dy, scratch_buf)
            to_right = lax.ppermute(out, AXIS, [(j, j + 1) for j in range(S - 1)])   # d's output at d + 1
            to_left = lax.ppermute(out, AXIS, [(j, j - 1) for j in range(1, S)])     # ... and at d - 1
            return ((to_right, to_left, out), buf, (ring, stashes), grads, (sums, report)), None

        carry = ((zeros_x, zeros_x, zeros_x), buf0, ring0, grads0, (zero_aux, report0))
        (_, _, _, (g_local, g_shared), sums), _ = lax.scan(tick, carry, jnp.arange(table.ticks))
        g_shared = lax.psum(g_shared, AXIS)   # the embedding's and the head's grads live on device 0
        sums = lax.psum(sums, AXIS)           # the loss's sums from device 0, each device's own report
        return jax.tree.map(lambda g: g[None], g_local), g_shared, sums

    fn = stage_shard_map(in_stage_rules(body, rules), mesh,
                         (stage_specs(chunks), replicated(shared), replicated(micro)),
                         (stage_specs(chunks), replicated(shared), P()))
    g_chunks, g_shared, (sums, report) = fn(chunks, shared, micro)
    return (sums, layer_order(report)), (unchunked(g_chunks, spec), g_shared)
