"""Pipeline parallelism: the stacked decoder layers split over the ``stage`` mesh axis. The entry points.

The model is not changed: the caller hands over three pure functions,

    pre(shared, mb) -> x                   the embedding of one micro batch
    stage(chunk, x, mb) -> (x, side)       a contiguous chunk of the stacked layers applied to x; side is
                                           (objective term, per-layer report): MoE router losses, which the
                                           pipeline adds to the loss, and their stats ({} for dense layers)
    post(shared, x, mb) -> (loss, aux)     loss sum to differentiate and a pytree of sums to report

where ``stacked`` holds the leaves with a leading ``layers`` axis, ``shared`` the rest (embedding, final norm,
head) and ``mb`` one micro batch (a dict of [micro_batch, seq] arrays). Schedules (S stages, M micro batches,
V virtual stages): ``gpipe`` and ``circular`` (:mod:`jaxtron.parallel.fill_drain`, a tick loop that is
differentiated), ``1f1b`` (:mod:`jaxtron.parallel.one_f_one_b`, forward and backward in one loop) and ``zb_h1``
(:mod:`jaxtron.parallel.zero_bubble`, 1f1b's loop with the backward split into B and a deferred W) and ``zbv``
(:mod:`jaxtron.parallel.zero_bubble_v`, two chunks per device in a V, B and W split, its own tick loop). The
layout they share (:class:`~jaxtron.parallel.pipeline_layout.PipelineSpec`, the per-stage chunks, the
``shard_map`` manual over ``stage`` only) is in :mod:`jaxtron.parallel.pipeline_layout`.

No stage forward runs twice (``parallel.pipeline_recompute=false``, the default): the backward of a micro batch
applies the VJP residuals its forward kept, which are what ``model.remat`` saves inside the stage (everything
under ``none``, the block inputs under ``full``; :mod:`jaxtron.parallel.residuals`). With
``parallel.pipeline_recompute=true`` a stage keeps only its input per micro batch and runs its forward again
in the backward: the least memory, one more stage forward per micro batch (4/3 of the model's matmul FLOPs
under ``remat=none``). The kept bytes are logged when the step is traced
(:func:`~jaxtron.parallel.pipeline_layout.log_memory`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxtron.parallel import embedding, one_f_one_b, zero_bubble, zero_bubble_v
from jaxtron.parallel.fill_drain import forward_outputs, post_loss
from jaxtron.parallel.pipeline_layout import PipelineSpec, chunked


def forward_loss(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                 stacked: Any, stacked_specs: Any, shared: Any, micro: dict, log_memory: bool = True,
                 compute_dtypes: Any = None):
    """``(loss, (aux, report))`` summed over the micro batches, through the gpipe/circular forward loop: the
    loss includes the stages' objective terms; ``report`` is theirs in layer order. Differentiable.
    ``log_memory``: log what differentiating it keeps (False for a forward that is not differentiated).
    ``compute_dtypes``: ``(stacked, shared)`` trees of the dtype each leaf is cast to once inside the loops
    (the stage loop that keeps residuals, the loss head's loop; see :data:`CAST_BEFORE_LOOP`), or None."""
    stacked_dtypes, shared_dtypes = (None, None) if compute_dtypes is None else compute_dtypes
    chunks = chunked(stacked, stacked_specs, spec, mesh)
    with embedding.gspmd_lookup():  # see there: XLA aborts on the per-device lookup here
        xs = jax.vmap(pre, in_axes=(None, 0))(shared, micro)                  # [M, mb, seq, d]
    dtype = xs.dtype
    if mesh.devices.flat[0].platform == "cpu":
        # XLA:CPU's bf16 all-reduce rewrite (ChangeOpDataType) aborts on the stage reductions of 16-bit
        # arrays at this boundary, so on CPU they cross it in fp32.
        xs = xs.astype(jnp.float32)
    outs, obj, report = forward_outputs(spec, mesh, rules, stage, chunks, xs, micro, dtype, log_memory,
                                        stacked_dtypes)
    loss, aux = post_loss(spec, post, shared, outs.astype(dtype), micro, shared_dtypes)
    return loss + obj, (aux, jax.tree.map(lax.stop_gradient, report))


# ``train.cast_params_once`` in a pipeline: the weights the model casts at use are cast once per step, not per
# tick, and each micro batch's gradient of the cast copy is converted to fp32 before the fp32 sum over micro
# batches (the numbers of the per-use casts, whose transposes do that). The schedules here sum the micro
# batches' gradients in their own loop, converting each first (one_f_one_b.TickContext.add_grads into an fp32
# carry): they take the copy cast before the loop, sharded as the params, so that under FSDP every gather of a
# weight (per tick, or once per step with parallel.pipeline_fsdp_gather_once) moves the compute dtype. gpipe and
# circular sum a weight's gradients over ticks in the backward of their loop, in the dtype of the loop's
# weights: their loop that keeps residuals (and the loss head's loop) takes the fp32 weights and casts them once
# inside, before its ticks, and sums the ticks' gradients in fp32 (fill_drain._kept_loop); their FSDP gathers
# (before the loop with gather_once) still move fp32, and their recomputing loop
# (parallel.pipeline_recompute=true), which autodiff differentiates, casts the stage weights per tick.
CAST_BEFORE_LOOP = ("1f1b", "zb_h1", "zbv")


def add_grads(acc: Any, grads: Any) -> Any:
    """The default ``accumulate`` of :func:`value_and_grad`: a sum."""
    return jax.tree.map(jnp.add, acc, grads)


def value_and_grad(spec: PipelineSpec, mesh: Mesh, rules, pre: Callable, stage: Callable, post: Callable,
                   stacked: Any, stacked_specs: Any, shared: Any, micro: dict, accumulate: Callable = add_grads,
                   compute_dtypes: Any = None):
    """``((aux_sums, report), (grads_stacked, grads_shared))`` of the summed loss over ``micro`` ([M, mb, seq]
    arrays).

    ``post`` returns ``(loss, aux)`` and ``stage`` ``(x, (objective term, per-layer report))``; the gradient is
    that of the sum over micro batches of ``loss`` and the stages' terms, in fp32; ``report`` is the stages'
    reports summed over micro batches, in layer order.
    ``stacked_specs`` are the PartitionSpecs of the stacked leaves (leading axis over 'stage').
    ``accumulate(acc, grads)`` adds a micro batch's gradients (``(stacked, shared)`` pairs) into the running
    total under 1f1b, whose loop accumulates them itself: a caller whose parameters hold state that combines
    otherwise than by a sum passes its own; the other schedules differentiate their loop, which sums.
    ``compute_dtypes``: for gpipe/circular, see :func:`forward_loss`; the schedules of :data:`CAST_BEFORE_LOOP` take
    ``stacked`` and ``shared`` already cast instead (their gradients come back in fp32 all the same)."""
    if spec.schedule in CAST_BEFORE_LOOP:
        if compute_dtypes is not None:
            raise ValueError(f"pipeline.value_and_grad: {spec.schedule} takes the weights already cast, not "
                             "compute_dtypes")
        if spec.schedule == "zbv":
            return zero_bubble_v.value_and_grad(spec, mesh, rules, pre, stage, post, stacked, stacked_specs, shared,
                                                micro, accumulate)
        make_tick = zero_bubble.zb_h1_tick if spec.schedule == "zb_h1" else None
        return one_f_one_b.value_and_grad(spec, mesh, rules, pre, stage, post, stacked, stacked_specs, shared, micro,
                                          accumulate, make_tick)

    def total(stacked, shared):
        loss, aux = forward_loss(spec, mesh, rules, pre, stage, post, stacked, stacked_specs, shared, micro,
                                 compute_dtypes=compute_dtypes)
        return loss, aux

    (_, aux), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(stacked, shared)
    return aux, jax.tree.map(lambda g: g.astype(jnp.float32), grads)
