"""The model's side of pipeline parallelism: splitting a batch into micro batches and a model into the three
parts :mod:`jaxtron.parallel.pipeline` runs (the embedding, a chunk of the stacked decoder layers, and the
logits with the loss).

The model only has to offer ``embed_tokens(tokens)``, ``rope(positions)`` and ``run_stack(key, x, rope,
segment_ids)``, and keep its stacked decoder blocks under the ``layers`` parameter key (the logical axis the
rules split over pipeline stages). The head and the loss stay the caller's: ``loss_sums(model, x,
micro_batch)``, ``x`` the last stage's output, returns ``(objective sum, (reported loss sum, token count, aux
sums))``. What else the pipeline needs of the model comes in a :class:`StageTerms` from the caller (this
package imports no model code): the stacks run before the stages, and how a stage's layers add to the loss
(MoE router losses, added to the objective in the stage that runs them, and their stats, added to the aux
sums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.parallel import pipeline
from jaxtron.parallel.fill_drain import cast_to
from jaxtron.parallel.sharding import constrain

STACKED = "layers"                 # the params key (and logical axis) of the stacked decoder blocks
BATCH_AXES = ("act_batch", "act_seq")


@dataclass(frozen=True)
class StageTerms:
    """What the pipeline needs to know of the model besides its methods.

    ``leading_stacks``: params keys of the stacks that run after the embedding, before the stages, in order
    (an MoE model's leading dense layers, not split over stages); ``layer_terms(stats, tokens)``: a stage's
    ``(objective term, per-layer report)`` from its layers' ``run_stack`` stats and the micro batch's token
    count; ``report_sums(report)``: the per-layer reports of all the stages -> the aux sums."""

    leading_stacks: tuple[str, ...]
    layer_terms: Callable
    report_sums: Callable


def split_micro(batch: dict, accum: int) -> dict:
    """[G, S] -> [accum, G/accum, S], micro batch a = rows a, a+accum, ...: each device keeps its own rows."""
    def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None,) + BATCH_AXES)
    return jax.tree.map(split, batch)


def _split_stacked(params: dict) -> tuple[dict, dict]:
    return params[STACKED], {k: v for k, v in params.items() if k != STACKED}


def _parts(graphdef, terms: StageTerms, params_struct: dict, loss_sums: Callable, segments: Callable):
    """pre/stage/post: each rebuilds the model from the params it needs; the others are scalar placeholders
    (the part of the forward it runs never reads them). ``terms.leading_stacks`` run in ``pre``, after the
    embedding; ``stage`` returns its layers' ``terms.layer_terms`` (loss term and per-layer report)."""
    stacked_struct, shared_struct = _split_stacked(params_struct)
    placeholder = lambda tree: jax.tree.map(lambda _: jnp.zeros((), jnp.float32), tree)
    model = lambda shared, layers: nnx.merge(graphdef, {**shared, STACKED: layers})

    def pre(shared, mb):
        m = model(shared, placeholder(stacked_struct))
        x = m.embed_tokens(mb["inputs"])
        for key in terms.leading_stacks:
            x = m.run_stack(key, x, m.rope(mb["positions"]), segments(mb))[0]
        return x

    def stage(layers, x, mb):
        m = model(placeholder(shared_struct), layers)
        x, stats = m.run_stack(STACKED, x, m.rope(mb["positions"]), segments(mb))
        return x, terms.layer_terms(stats, jnp.sum(mb["loss_mask"].astype(jnp.float32)))

    def post(shared, x, mb):
        return loss_sums(model(shared, placeholder(stacked_struct)), x, mb)

    return pre, stage, post


def _stacked_specs(param_shardings: dict):
    return jax.tree.map(lambda sh: sh.spec, param_shardings[STACKED])


def pipelined_value_and_grad(layout, graphdef, terms: StageTerms, param_shardings: dict, loss_sums: Callable,
                             segments: Callable, params: dict, batch: dict, accumulate: Optional[Callable] = None,
                             compute_dtypes: Optional[dict] = None):
    """((loss sum, tokens, aux), fp32 grads) of the whole batch through the pipeline schedule, its micro batches
    as in gradient accumulation (``accumulate(acc, grads)`` on params-shaped trees: see
    ``pipeline.value_and_grad``; default a sum). ``compute_dtypes`` (``train.cast_params_once``): a params-shaped
    tree of the dtype the model casts each leaf to at its use (a leaf's own dtype: not cast); the weights are
    then cast once per step instead of in every tick, with the per-use casts' numbers (see
    ``pipeline.CAST_BEFORE_LOOP``)."""
    pre, stage, post = _parts(graphdef, terms, params, loss_sums, segments)
    spec = layout.pipeline()
    dtypes = None if compute_dtypes is None else _split_stacked(compute_dtypes)
    if dtypes is not None and spec.schedule in pipeline.CAST_BEFORE_LOOP:
        # sharded as the params: each rank casts its shard, and the gathers of the chunks move the cast copy
        params = jax.lax.with_sharding_constraint(cast_to(params, compute_dtypes), param_shardings)
        dtypes = None
    stacked, shared = _split_stacked(params)
    micro = split_micro(batch, spec.micro_batches)
    joined = lambda pair: {**pair[1], STACKED: pair[0]}
    combine = pipeline.add_grads if accumulate is None else \
        (lambda acc, g: _split_stacked(accumulate(joined(acc), joined(g))))
    (sums, report), (g_stacked, g_shared) = pipeline.value_and_grad(
        spec, layout.mesh, layout.rules, pre, stage, post, stacked, _stacked_specs(param_shardings), shared, micro,
        combine, dtypes)
    return _with_report(terms, sums, report), {**g_shared, STACKED: g_stacked}


def _with_report(terms: StageTerms, sums, report: dict):
    """The loss's (loss sum, tokens, aux sums) with the stages' report added to the aux sums."""
    ce, n, aux = sums
    return ce, n, {**aux, **terms.report_sums(report)}


def pipelined_loss(layout, graphdef, terms: StageTerms, param_shardings: dict, loss_sums: Callable,
                   segments: Callable, params: dict, batch: dict):
    """The forward only (evaluation): ``(objective, (loss sum, tokens, aux))`` of the whole batch."""
    pre, stage, post = _parts(graphdef, terms, params, loss_sums, segments)
    stacked, shared = _split_stacked(params)
    spec = layout.pipeline(for_eval=True)
    objective, (sums, report) = pipeline.forward_loss(spec, layout.mesh, layout.rules, pre, stage, post, stacked,
                                                      _stacked_specs(param_shardings), shared,
                                                      split_micro(batch, spec.micro_batches), log_memory=False)
    return objective, _with_report(terms, sums, report)

