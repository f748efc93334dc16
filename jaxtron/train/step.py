"""The pure, jitted train and eval steps (state buffers donated), with gradient accumulation inside."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxtron.config import Config, ConfigError, ModelConfig
from jaxtron.model import routing
from jaxtron.model.llama import layer_stacks
from jaxtron.parallel.layout import Layout
from jaxtron.parallel.stages import (BATCH_AXES, STACKED, StageTerms, pipelined_loss, pipelined_value_and_grad,
                                     split_micro)
from jaxtron.train.flops import moe_layer_count
from jaxtron.train.loss import chunked_cross_entropy_sums, cross_entropy_sums, mtp_key, with_mtp_targets
from jaxtron.train.param_cast import ParamCast
from jaxtron.train.state import ModelSpec
from jaxtron.train.xla_options import compiler_options

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def batch_sharding(layout: Layout) -> NamedSharding:
    return layout.sharding(BATCH_AXES)


def _f32zero() -> jax.Array:
    return jnp.zeros((), jnp.float32)


def _segments(batch: dict, packed: bool):
    """The segment ids attention follows: only with ``data.reset_at_eod`` (otherwise the batch's are all one
    document, and plain causal attention takes the kernels' fast path: cuDNN has no segment ids), or when the
    layout reorders the sequence (context parallelism: the mask then follows positions within segments)."""
    return batch["segment_ids"] if packed else None


def _head_sums(model, hidden, batch, z_loss: float, chunk_tokens: int):
    """(objective sum, (reported loss sum, token count, aux sums)) of the built-in loss on the final-normed
    ``hidden`` states: the LM head and cross entropy of the whole micro batch, or with ``chunk_tokens``
    (``model.loss_chunk_tokens``) a chunk at a time, never holding the whole micro batch's logits."""
    targets, mask = batch["targets"], batch["loss_mask"]
    if chunk_tokens:
        weight = model.head_weight(gathered=True)  # gathered once, outside the loop over the chunks
        ce, z, n = chunked_cross_entropy_sums(model.head, weight, hidden, targets, mask, z_loss, chunk_tokens)
    else:
        ce, z, n = cross_entropy_sums(model.head(hidden), targets, mask, z_loss)
    return ce + z, (ce, n, {})


MTP_LOAD = "mtp_moe_load"  # the MTP MoE blocks' expert load [D, E]: their biases' update, not a logged metric


def _mtp_sums(model, h, batch, segment_ids, n, chunk_tokens: int):
    """(objective term, aux) of the multi-token-prediction modules (docs/mtp.md) on ``h``, the main model's last
    hidden state before its final norm: ``loss_coef`` times the mean over the depths of each depth's summed
    cross entropy (per token once the step divides by the main loss's count ``n``: the paper's 1/T), plus
    the MoE blocks' router losses (means over the MTP's MoE layers). ``aux["mtp_loss"]``: that mean
    unweighted (no gradient); for MoE blocks ``aux["mtp_moe_load"]`` [D, E], their aux-free biases' update."""
    cfg = model.cfg
    depth = cfg.mtp.num_layers
    inputs = jnp.stack([batch[mtp_key("inputs", k)] for k in range(1, depth + 1)])
    hidden, stats = model.mtp_hidden(h, inputs, batch["positions"], segment_ids)
    weight = model.head_weight(gathered=True) if chunk_tokens else None
    total = _f32zero()
    for k in range(1, depth + 1):
        targets, mask = batch[mtp_key("targets", k)], batch[mtp_key("mask", k)]
        if chunk_tokens:
            ce = chunked_cross_entropy_sums(model.head, weight, hidden[k - 1], targets, mask, 0.0, chunk_tokens)[0]
        else:
            ce = cross_entropy_sums(model.head(hidden[k - 1]), targets, mask)[0]
        total = total + ce
    mean = total / depth
    objective = cfg.mtp.loss_coef * mean
    aux = {"mtp_loss": jax.lax.stop_gradient(mean)}
    if stats is not None:
        term, report = routing.layer_terms(stats, n, cfg.moe, depth)
        objective, aux[MTP_LOAD] = objective + term, report["moe_load"]
    return objective, aux


def _global_chunk_tokens(cfg: Config, layout: Layout) -> int:
    """``model.loss_chunk_tokens`` (per device) over the whole micro batch: times the ways its tokens are split
    (rows over data x fsdp x expert, sequences over context); 0: off."""
    return cfg.model.loss_chunk_tokens * layout.dp * layout.context


def _last_stage_sums(z_loss: float, chunk_tokens: int, mtp_segments: Optional[Callable] = None) -> Callable:
    """The pipeline's loss callback: :func:`_head_sums` of the last stage's output, final norm first; with
    ``mtp_segments`` (the micro batch -> its segment ids) the MTP modules run here too, on the last stage."""
    def sums(model, x, batch):
        objective, (ce, n, aux) = _head_sums(model, model.final_norm(x), batch, z_loss, chunk_tokens)
        if mtp_segments is None:
            return objective, (ce, n, aux)
        term, mtp_aux = _mtp_sums(model, x, batch, mtp_segments(batch), n, chunk_tokens)
        return objective + term, (ce, n, {**aux, **mtp_aux})
    return sums


def _sums(graphdef, params, batch, z_loss: float, packed: bool = True, chunk_tokens: int = 0, mtp: bool = False):
    """``mtp``: add the multi-token-prediction loss (the batch holds :func:`with_mtp_targets`' arrays)."""
    model = nnx.merge(graphdef, params)
    segment_ids = _segments(batch, packed)
    x, stats = model.run_layers_with_stats(model.embed_tokens(batch["inputs"]), batch["positions"], segment_ids)
    objective, (ce, n, aux) = _head_sums(model, model.final_norm(x), batch, z_loss, chunk_tokens)
    if mtp:
        term, mtp_aux = _mtp_sums(model, x, batch, segment_ids, n, chunk_tokens)
        objective, aux = objective + term, {**aux, **mtp_aux}
    if not model.cfg.moe.num_experts:
        return objective, (ce, n, aux)
    # The MoE losses are means over the micro batch's tokens; weighted by its token count, they add
    # coef * loss to the per-token objective the step divides by the total count (micro batches by share).
    term, report = routing.layer_terms(stats, n, model.cfg.moe, moe_layer_count(model.cfg))
    return objective + term, (ce, n, {**aux, **routing.report_sums(report)})


def stage_terms(cfg: ModelConfig) -> StageTerms:
    """What the pipeline needs of the model besides its methods: the stacks that run before the stages (an MoE
    model's leading dense layers) and the stages' MoE router terms (one MoE layer per scanned unit)."""
    stacks = layer_stacks(cfg)
    units = dict((key, units) for key, units, _ in stacks)[STACKED]
    return StageTerms(tuple(key for key, _, _ in stacks if key != STACKED),
                      lambda stats, n: routing.layer_terms(stats, n, cfg.moe, units), routing.report_sums)


# names a custom loss's aux entries may not take: the step's metrics and the loop's metrics.jsonl record
RESERVED_METRICS = ("step", "loss", "grad_norm", "lr", "tokens", "skipped", "skipped_steps", "eval_loss",
                    "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
                    "tflops_per_device_causal", "mfu", "mfu_causal", "moe_load", "moe_dropped", "moe_assigned",
                    "moe_load_max_over_mean", "mtp_loss", MTP_LOAD)


def _custom_sums(loss_fn: Callable, graphdef, params, batch):
    """A user loss ``loss_fn(model, batch) -> (loss_sum, aux)`` in the shape of :func:`_sums`."""
    model = nnx.merge(graphdef, params)
    out = loss_fn(model, batch)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"loss_fn must return (loss_sum, aux), got {type(out).__name__}")
    loss_sum, aux = out
    loss_sum = jnp.asarray(loss_sum)
    if loss_sum.shape != () or not jnp.issubdtype(loss_sum.dtype, jnp.floating):
        raise TypeError(f"loss_fn: loss_sum must be a float scalar, got {loss_sum.dtype}{list(loss_sum.shape)}")
    aux = {} if aux is None else aux
    if not isinstance(aux, dict):
        raise TypeError(f"loss_fn: aux must be a dict of scalars (or None), got {type(aux).__name__}")
    sums = {}
    for k, v in aux.items():
        v = jnp.asarray(v)
        if k in RESERVED_METRICS or not isinstance(k, str):
            raise ValueError(f"loss_fn: aux key {k!r} is reserved or not a string (reserved: {RESERVED_METRICS})")
        if v.shape != ():
            raise TypeError(f"loss_fn: aux[{k!r}] must be a scalar, got shape {list(v.shape)}")
        sums[k] = v.astype(jnp.float32)
    n = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    return loss_sum, (loss_sum.astype(jnp.float32), n, sums)


def _compute_dtypes(cfg: Config, sums: Callable, params, micro) -> Optional[dict]:
    """With ``train.cast_params_once``, a params-shaped tree of the dtype ``sums(params, micro)`` casts each leaf
    to at its use (a leaf's own dtype where it is not cast), for the pipeline; None: nothing to cast."""
    cast = ParamCast(sums, params, micro) if cfg.train.cast_params_once else None
    return cast.dtype_tree(params) if cast is not None and cast.any else None


def _cast_once(cfg: Config, spec: ModelSpec, sums: Callable, params, micro):
    """``params`` with the leaves ``sums(params, micro)`` casts at their use already cast, once for all the micro
    batches (``train.cast_params_once``; jaxtron/train/param_cast.py), sharded as the params: under FSDP each
    rank casts its shard."""
    cast = ParamCast(sums, params, micro) if cfg.train.cast_params_once else None
    if cast is None or not cast.any:  # fp32 compute, or bf16 master weights: nothing to cast
        return params
    return jax.lax.with_sharding_constraint(cast.cast(params), spec.param_shardings)


def _micro_struct(batch: dict, micro_batches: int) -> dict:
    """The shapes of one of ``micro_batches`` micro batches of ``batch`` (what :class:`ParamCast` traces on)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // micro_batches, *x.shape[1:]), x.dtype), batch)


def make_loss_and_grads(cfg: Config, spec: ModelSpec, layout: Layout,
                        loss_fn: Optional[Callable] = None) -> Callable:
    """``(params, batch) -> ((loss_sum, tokens, aux_sums), grads)``: the summed reported loss (cross entropy, or
    a custom ``loss_fn``'s), the token count, the custom loss's aux sums and the fp32 gradient of the summed
    objective over the whole batch, through gradient accumulation or the pipeline schedule. Pure; trace it
    under ``layout.tracing()``."""
    accum = layout.accumulation_steps
    z_loss = cfg.optim.z_loss
    chunk_tokens = _global_chunk_tokens(cfg, layout)
    packed = cfg.data.reset_at_eod or layout.reorders_sequences  # see _segments
    mtp = cfg.model.mtp.num_layers
    if loss_fn is None:
        sums = lambda p, b: _sums(spec.graphdef, p, b, z_loss, packed, chunk_tokens, bool(mtp))
    else:
        sums = lambda p, b: _custom_sums(loss_fn, spec.graphdef, p, b)
    grad_fn = jax.value_and_grad(sums, has_aux=True)
    if chunk_tokens and loss_fn is not None:  # refused, never silently ignored
        raise ConfigError("model.loss_chunk_tokens", "chunks the built-in loss only; a custom loss_fn computes its "
                          "own logits (jaxtron.train.loss.chunked_cross_entropy_sums chunks a head for it)")
    if mtp and loss_fn is not None:
        raise ConfigError("model.mtp.num_layers", "the MTP loss is the built-in loss's; a custom loss_fn would leave "
                          "the MTP modules untrained (set model.mtp.num_layers=0)")
    if layout.stages > 1 and loss_fn is not None:
        raise ValueError("a custom loss_fn(model, batch) cannot run with parallel.stage > 1: the pipeline computes "
                         "the loss from the last stage's hidden states, not from a whole model")

    def loss_and_grads(params, batch):
        if mtp:  # shifted before the load balance reorders the sequences
            batch = with_mtp_targets(batch, mtp, packed)
        batch = layout.balance(batch)  # context parallelism: each rank's two chunks of every sequence
        if layout.stages > 1:
            segments = (lambda mb: _segments(mb, packed)) if mtp else None
            # the weights the model casts per use, cast once per step, not per tick (the schedules' own rule for
            # where, with the per-use numbers: jaxtron/parallel/pipeline.py, CAST_BEFORE_LOOP)
            dtypes = _compute_dtypes(cfg, sums, params, _micro_struct(batch, layout.accumulation_steps))
            return pipelined_value_and_grad(layout, spec.graphdef, stage_terms(cfg.model), spec.param_shardings,
                                            _last_stage_sums(z_loss, chunk_tokens, segments),
                                            lambda mb: _segments(mb, packed), params, batch,
                                            spec.histories.accumulate, dtypes)
        micro = split_micro(batch, accum) if accum > 1 else None
        first = batch if micro is None else jax.tree.map(lambda x: x[0], micro)
        # the weights the loss casts per use, cast once for all the micro batches (jaxtron/train/param_cast.py);
        # their bf16 gradients go back to fp32 before they are summed, as the per-use casts' transposes do
        low = _cast_once(cfg, spec, sums, params, first)
        to_fp32 = lambda g: jax.tree.map(lambda g, p: g.astype(p.dtype), g, params)  # noqa: E731
        if accum == 1:
            (_, out), grads = grad_fn(low, batch)
            return out, to_fp32(grads)

        # ZeRO-2 keeps the accumulator split over data too, so each micro batch's gradient is reduce-scattered
        # into its shard instead of all-reduced whole
        acc_sh = spec.moment_shardings if cfg.parallel.zero >= 2 else spec.param_shardings

        def body(carry, micro):
            g_acc, ce_acc, n_acc, aux_acc = carry
            (_, (ce, n, aux)), g = grad_fn(low, micro)
            g_acc = spec.histories.accumulate(g_acc, to_fp32(g))
            if cfg.parallel.zero >= 2:
                g_acc = jax.lax.with_sharding_constraint(g_acc, acc_sh)
            return (g_acc, ce_acc + ce, n_acc + n, jax.tree.map(jnp.add, aux_acc, aux)), None

        zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s),
                             params, acc_sh)
        aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),  # the aux sums, from the loss's trace
                            jax.eval_shape(sums, params, first)[1][2])
        (grads, ce, n, aux), _ = jax.lax.scan(body, (zeros, _f32zero(), _f32zero(), aux0), micro)
        return (ce, n, aux), grads

    return loss_and_grads


def make_train_step(cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation, schedule: Callable,
                    layout: Layout, loss_fn: Optional[Callable] = None, return_grads: bool = False):
    """The jitted train step. ``loss_fn(model, batch) -> (loss_sum, aux)`` replaces the built-in cross entropy
    (plus ``optim.z_loss``); see :class:`jaxtron.train.trainer.Trainer` for the contract. ``return_grads``:
    the metrics also hold ``grads``, the gradient per loss token the optimizer was handed (before clipping), so
    that a check of a layout's gradients and of its training compiles one program, not this and
    :func:`make_gradients`."""
    loss_and_grads = make_loss_and_grads(cfg, spec, layout, loss_fn)

    def step(state, batch):
        with layout.tracing():
            params = state["params"]
            (ce, n, aux), raw = loss_and_grads(params, batch)
            n = jnp.maximum(n, 1.0)
            grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), spec.histories.without(raw), params)
            grad_norm = optax.global_norm(grads)
            if cfg.parallel.zero >= 2:  # reduce-scattered over data: each rank updates its shard of the state
                grads = jax.lax.with_sharding_constraint(grads, spec.moment_shardings)
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            if cfg.parallel.zero:  # the update on the shard; the new params leave all-gathered over data
                updates = jax.lax.with_sharding_constraint(updates, spec.moment_shardings)
            new_params = optax.apply_updates(params, updates)
            # A non-finite loss or gradient norm skips the update: params and optimizer state stay as they were
            # (the step counter, i.e. the data position, still advances).
            ok = jnp.isfinite(ce) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(ok, new, old)
            mtp_load = aux.pop(MTP_LOAD, None)
            aux, moe_load = routing.step_metrics(aux, n)
            if moe_load is not None and cfg.model.moe.aux_free_bias:  # DeepSeek-V3: no gradient, from the load
                rate = cfg.model.moe.bias_update_rate
                main = {k: v for k, v in new_params.items() if k != "mtp"}  # each bias from its own layers' load
                new_params = {**routing.update_expert_bias(main, moe_load, rate),
                              **({"mtp": routing.update_expert_bias(new_params["mtp"], mtp_load, rate)}
                                 if mtp_load is not None else {})}
            new_params = jax.tree.map(keep, spec.histories.roll(new_params, params, raw), params)
            opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
            metrics = {"loss": ce / n, "grad_norm": grad_norm, "lr": schedule(state["step"]), "tokens": n,
                       "skipped": jnp.logical_not(ok), **aux, **({"grads": grads} if return_grads else {})}
            return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    return jax.jit(step, in_shardings=(spec.state_shardings, batch_sharding(layout)),
                   out_shardings=(spec.state_shardings, None), donate_argnums=(0,),
                   compiler_options=compiler_options(cfg, layout))


def make_gradients(cfg: Config, spec: ModelSpec, layout: Layout, batch_sh: NamedSharding,
                   loss_fn: Optional[Callable] = None):
    """Jitted ``(params, batch) -> (grads, metrics)``: the fp32 gradient of the loss per loss token (what the
    train step hands the optimizer, before clipping) and ``loss``, ``grad_norm``, ``tokens``."""
    loss_and_grads = make_loss_and_grads(cfg, spec, layout, loss_fn)

    def grads(params, batch):
        with layout.tracing():
            (ce, n, _), g = loss_and_grads(params, batch)
            n = jnp.maximum(n, 1.0)
            g = jax.tree.map(lambda x: x / n, spec.histories.without(g))
            return g, {"loss": ce / n, "grad_norm": optax.global_norm(g), "tokens": n}

    return jax.jit(grads, in_shardings=(spec.param_shardings, batch_sh), compiler_options=compiler_options(cfg, layout))


def make_eval_step(cfg: Config, spec: ModelSpec, layout: Layout):
    packed = cfg.data.reset_at_eod or layout.reorders_sequences  # see _segments
    chunk_tokens = _global_chunk_tokens(cfg, layout)

    def evaluate(params, batch):
        batch = layout.balance(batch)
        with layout.tracing():
            sums = lambda p, b: _sums(spec.graphdef, p, b, 0.0, packed, chunk_tokens)  # noqa: E731
            if layout.stages > 1:  # a forward only: every schedule takes the weights cast once
                low = _cast_once(cfg, spec, sums, params, _micro_struct(batch, layout.accumulation_steps))
                _, (ce, n, _) = pipelined_loss(layout, spec.graphdef, stage_terms(cfg.model), spec.param_shardings,
                                               _last_stage_sums(0.0, chunk_tokens),
                                               lambda mb: _segments(mb, packed), low, batch)
                return {"loss_sum": ce, "tokens": n}

            micro = split_micro(batch, layout.accumulation_steps)
            params = _cast_once(cfg, spec, sums, params, jax.tree.map(lambda x: x[0], micro))  # as the train step

            def body(carry, micro):
                _, (ce, n, _) = sums(params, micro)
                return (carry[0] + ce, carry[1] + n), None
            (ce, n), _ = jax.lax.scan(body, (_f32zero(), _f32zero()), micro)
            return {"loss_sum": ce, "tokens": n}

    return jax.jit(evaluate, in_shardings=(spec.param_shardings, batch_sharding(layout)),
                   compiler_options=compiler_options(cfg, layout))
