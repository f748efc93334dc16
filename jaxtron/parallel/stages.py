"""The model's side of pipeline parallelism: splitting a batch into micro batches and a model into the three
parts :mod:`jaxtron.parallel.pipeline` runs (the embedding, a chunk of the stacked decoder layers, and the
logits with the loss).

The model only has to offer ``embed_tokens(tokens)``, ``rope(positions)``, ``run_stack(key, x, rope,
segment_ids)`` and ``logits(x)``, and keep its stacked decoder blocks under the ``layers`` parameter key (the
logical axis the rules split over pipeline stages). The loss stays the caller's: ``loss_sums(logits,
micro_batch)`` returns ``(objective sum, (reported loss sum, token count, aux sums))``. MoE layers add their
router losses to the objective in the stage that runs them, and their stats to the aux sums.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.model import routing
from jaxtron.model.llama import layer_stacks
from jaxtron.parallel import pipeline
from jaxtron.parallel.sharding import constrain

STACKED = "layers"                 # the params key (and logical axis) of the stacked decoder blocks
BATCH_AXES = ("act_batch", "act_seq")


def split_micro(batch: dict, accum: int) -> dict:
    """[G, S] -> [accum, G/accum, S], micro batch a = rows a, a+accum, ...: each device keeps its own rows."""
    def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None,) + BATCH_AXES)
    return jax.tree.map(split, batch)


def _split_stacked(params: dict) -> tuple[dict, dict]:
    return params[STACKED], {k: v for k, v in params.items() if k != STACKED}


def _parts(graphdef, params_struct: dict, loss_sums: Callable, segments: Callable):
    """pre/stage/post: each rebuilds the model from the params it needs; the others are scalar placeholders
    (the part of the forward it runs never reads them). An MoE model's leading dense layers (``dense_layers``,
    not split over stages) run in ``pre``, after the embedding; ``stage`` returns its MoE layers' loss term
    and per-layer report (:func:`jaxtron.model.routing.layer_terms`), zero and {} for a dense model."""
    stacked_struct, shared_struct = _split_stacked(params_struct)
    placeholder = lambda tree: jax.tree.map(lambda _: jnp.zeros((), jnp.float32), tree)
    model = lambda shared, layers: nnx.merge(graphdef, {**shared, STACKED: layers})

    def pre(shared, mb):
        m = model(shared, placeholder(stacked_struct))
        x = m.embed_tokens(mb["inputs"])
        for key, _, _ in layer_stacks(m.cfg):
            if key != STACKED:
                x = m.run_stack(key, x, m.rope(mb["positions"]), segments(mb))[0]
        return x

    def stage(layers, x, mb):
        m = model(placeholder(shared_struct), layers)
        x, stats = m.run_stack(STACKED, x, m.rope(mb["positions"]), segments(mb))
        n = jnp.sum(mb["loss_mask"].astype(jnp.float32))
        moe_layers = dict((key, units) for key, units, _ in layer_stacks(m.cfg))[STACKED]  # one per MoE unit
        return x, routing.layer_terms(stats, n, m.cfg.moe, moe_layers)

    def post(shared, x, mb):
        return loss_sums(model(shared, placeholder(stacked_struct)).logits(x), mb)

    return pre, stage, post


def _stacked_specs(param_shardings: dict):
    return jax.tree.map(lambda sh: sh.spec, param_shardings[STACKED])


def pipelined_value_and_grad(layout, graphdef, param_shardings: dict, loss_sums: Callable, segments: Callable,
                             params: dict, batch: dict, accumulate: Callable = pipeline._add):
    """((loss sum, tokens, aux), fp32 grads) of the whole batch through the pipeline schedule, its micro batches
    as in gradient accumulation (``accumulate``: see ``pipeline.value_and_grad``)."""
    pre, stage, post = _parts(graphdef, params, loss_sums, segments)
    stacked, shared = _split_stacked(params)
    spec = layout.pipeline()
    micro = split_micro(batch, spec.micro_batches)
    (sums, report), (g_stacked, g_shared) = pipeline.value_and_grad(
        spec, layout.mesh, layout.rules, pre, stage, post, stacked, _stacked_specs(param_shardings), shared, micro,
        accumulate)
    return _with_report(sums, report), {**g_shared, STACKED: g_stacked}


def _with_report(sums, report: dict):
    """The loss's (loss sum, tokens, aux sums) with the stages' MoE report added to the aux sums."""
    ce, n, aux = sums
    return ce, n, {**aux, **routing.report_sums(report)}


def pipelined_loss(layout, graphdef, param_shardings: dict, loss_sums: Callable, segments: Callable,
                   params: dict, batch: dict):
    """The forward only (evaluation): ``(objective, (loss sum, tokens, aux))`` of the whole batch."""
    pre, stage, post = _parts(graphdef, params, loss_sums, segments)
    stacked, shared = _split_stacked(params)
    spec = layout.pipeline(for_eval=True)
    objective, (sums, report) = pipeline.forward_loss(spec, layout.mesh, layout.rules, pre, stage, post, stacked,
                                                      _stacked_specs(param_shardings), shared,
                                                      split_micro(batch, spec.micro_batches))
    return objective, _with_report(sums, report)

