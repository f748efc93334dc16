"""The pure, jitted train and eval steps (state buffers donated), with gradient accumulation inside."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtron.config import Config, micro_batch_size
from jaxtron.parallel import pipeline
from jaxtron.parallel.sharding import constrain, logical_to_spec, use_rules
from jaxtron.train.loss import cross_entropy_sums
from jaxtron.train.state import ModelSpec

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
BATCH_AXES = ("act_batch", "act_seq")


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(BATCH_AXES, rules))


def accumulation_steps(cfg: Config, dp: int) -> int:
    return cfg.train.global_batch_size // (micro_batch_size(cfg.train, dp) * dp)


def _split_micro(batch: dict, accum: int) -> dict:
    """[G, S] -> [accum, G/accum, S], micro batch a = rows a, a+accum, ...: each device keeps its own rows."""
    def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None,) + BATCH_AXES)
    return jax.tree.map(split, batch)


def _f32zero() -> jax.Array:
    return jnp.zeros((), jnp.float32)


def _segments(batch: dict, packed: bool):
    """The segment ids attention follows: only with ``data.reset_at_eod`` (otherwise the batch's are all one
    document, and plain causal attention takes the kernels' fast path: cuDNN has no segment ids)."""
    return batch["segment_ids"] if packed else None


def _sums(graphdef, params, batch, z_loss: float, packed: bool = True):
    """(objective sum, (reported loss sum, token count, aux sums)) of the built-in loss."""
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["positions"], _segments(batch, packed))
    ce, z, n = cross_entropy_sums(logits, batch["targets"], batch["loss_mask"], z_loss)
    return ce + z, (ce, n, {})


# names a custom loss's aux entries may not take: the step's metrics and the loop's metrics.jsonl record
RESERVED_METRICS = ("step", "loss", "grad_norm", "lr", "tokens", "skipped", "skipped_steps", "eval_loss",
                    "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
                    "tflops_per_device_causal", "mfu", "mfu_causal")


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


STACKED = "layers"  # the model's stacked decoder blocks (leading 'layers' axis): what a pipeline splits


def pipeline_spec(cfg: Config, mesh: Mesh, micro_batches: int, for_eval: bool = False):
    """The pipeline schedule for this mesh, or None without pipeline stages. Evaluation (forward only) runs
    the 1f1b configuration through the gpipe loop."""
    stages = mesh.shape["stage"]
    if stages == 1:
        return None
    schedule = cfg.parallel.pipeline_schedule
    if for_eval and schedule == "1f1b":
        schedule = "gpipe"
    return pipeline.PipelineSpec(stages, micro_batches, schedule, cfg.parallel.virtual_stages,
                                 cfg.parallel.pipeline_fsdp_gather_once)


def _split_stacked(params: dict) -> tuple[dict, dict]:
    return params[STACKED], {k: v for k, v in params.items() if k != STACKED}


def _pipeline_parts(graphdef, params_struct: dict, z_loss: float, packed: bool):
    """pre/stage/post for :mod:`jaxtron.parallel.pipeline`: the embedding, a chunk of the stacked layers, and
    the logits with the loss sums. Each rebuilds the model from the params it needs; the others are scalar
    placeholders (the part of the forward it runs never reads them)."""
    stacked_struct, shared_struct = _split_stacked(params_struct)
    placeholder = lambda tree: jax.tree.map(lambda _: jnp.zeros((), jnp.float32), tree)
    model = lambda shared, layers: nnx.merge(graphdef, {**shared, STACKED: layers})

    def pre(shared, mb):
        return model(shared, placeholder(stacked_struct)).embed_tokens(mb["inputs"])

    def stage(layers, x, mb):
        return model(placeholder(shared_struct), layers).run_layers(x, mb["positions"], _segments(mb, packed))

    def post(shared, x, mb):
        logits = model(shared, placeholder(stacked_struct)).logits(x)
        ce, z, n = cross_entropy_sums(logits, mb["targets"], mb["loss_mask"], z_loss)
        return ce + z, (ce, n, {})

    return pre, stage, post


def _pipelined_grads(pspec, spec: ModelSpec, mesh: Mesh, rules, z_loss: float, packed: bool, params: dict,
                     batch: dict):
    """((ce, tokens, {}), fp32 grads) of the whole batch through the pipeline, its micro batches as in
    accumulation."""
    pre, stage, post = _pipeline_parts(spec.graphdef, params, z_loss, packed)
    stacked, shared = _split_stacked(params)
    stacked_specs = jax.tree.map(lambda sh: sh.spec, spec.param_shardings[STACKED])
    micro = _split_micro(batch, pspec.micro_batches)
    sums, (g_stacked, g_shared) = pipeline.value_and_grad(pspec, mesh, rules, pre, stage, post, stacked,
                                                          stacked_specs, shared, micro)
    return sums, {**g_shared, STACKED: g_stacked}


def make_loss_and_grads(cfg: Config, spec: ModelSpec, mesh: Mesh, rules, dp: int,
                        loss_fn: Optional[Callable] = None) -> Callable:
    """``(params, batch) -> ((loss_sum, tokens, aux_sums), grads)``: the summed reported loss (cross entropy, or
    a custom ``loss_fn``'s), the token count, the custom loss's aux sums and the fp32 gradient of the summed
    objective over the whole batch, through gradient accumulation or the pipeline schedule. Pure; trace it
    under ``use_rules(rules, mesh)``."""
    accum = accumulation_steps(cfg, dp)
    z_loss = cfg.optim.z_loss
    packed = cfg.data.reset_at_eod
    if loss_fn is None:
        sums = lambda p, b: _sums(spec.graphdef, p, b, z_loss, packed)
    else:
        sums = lambda p, b: _custom_sums(loss_fn, spec.graphdef, p, b)
    grad_fn = jax.value_and_grad(sums, has_aux=True)
    pspec = pipeline_spec(cfg, mesh, accum)
    if pspec is not None and loss_fn is not None:
        raise ValueError("a custom loss_fn(model, batch) cannot run with parallel.stage > 1: the pipeline computes "
                         "the loss from the last stage's hidden states, not from a whole model")

    def loss_and_grads(params, batch):
        if pspec is not None:
            return _pipelined_grads(pspec, spec, mesh, rules, z_loss, packed, params, batch)
        if accum == 1:
            (_, out), grads = grad_fn(params, batch)
            return out, grads

        def body(carry, micro):
            g_acc, ce_acc, n_acc, aux_acc = carry
            (_, (ce, n, aux)), g = grad_fn(params, micro)
            return (jax.tree.map(jnp.add, g_acc, g), ce_acc + ce, n_acc + n,
                    jax.tree.map(jnp.add, aux_acc, aux)), None

        zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s),
                             params, spec.param_shardings)
        micro = _split_micro(batch, accum)
        aux0 = jax.tree.map(lambda _: _f32zero(),  # the aux sums' names, from the loss's trace
                            jax.eval_shape(sums, params, jax.tree.map(lambda x: x[0], micro))[1][2])
        (grads, ce, n, aux), _ = jax.lax.scan(body, (zeros, _f32zero(), _f32zero(), aux0), micro)
        return (ce, n, aux), grads

    return loss_and_grads


def make_train_step(cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation, schedule: Callable,
                    mesh: Mesh, rules, dp: int, loss_fn: Optional[Callable] = None):
    """The jitted train step. ``loss_fn(model, batch) -> (loss_sum, aux)`` replaces the built-in cross entropy
    (plus ``optim.z_loss``); see :class:`jaxtron.train.loop.Trainer` for the contract."""
    loss_and_grads = make_loss_and_grads(cfg, spec, mesh, rules, dp, loss_fn)

    def step(state, batch):
        with use_rules(rules, mesh):
            params = state["params"]
            (ce, n, aux), grads = loss_and_grads(params, batch)
            n = jnp.maximum(n, 1.0)
            grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grads, params)
            grad_norm = optax.global_norm(grads)
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
            # A non-finite loss or gradient norm skips the update: params and optimizer state stay as they were
            # (the step counter, i.e. the data position, still advances).
            ok = jnp.isfinite(ce) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(ok, new, old)
            new_params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
            metrics = {"loss": ce / n, "grad_norm": grad_norm, "lr": schedule(state["step"]), "tokens": n,
                       "skipped": jnp.logical_not(ok), **{k: v / n for k, v in aux.items()}}
            return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    return jax.jit(step, in_shardings=(spec.state_shardings, batch_sharding(mesh, rules)),
                   out_shardings=(spec.state_shardings, None), donate_argnums=(0,))


def make_eval_step(cfg: Config, spec: ModelSpec, mesh: Mesh, rules, dp: int):
    accum = accumulation_steps(cfg, dp)
    pspec = pipeline_spec(cfg, mesh, accum, for_eval=True)

    def evaluate(params, batch):
        with use_rules(rules, mesh):
            if pspec is not None:
                pre, stage, post = _pipeline_parts(spec.graphdef, params, 0.0, cfg.data.reset_at_eod)
                stacked, shared = _split_stacked(params)
                stacked_specs = jax.tree.map(lambda sh: sh.spec, spec.param_shardings[STACKED])
                _, (ce, n, _) = pipeline.forward_loss(pspec, mesh, rules, pre, stage, post, stacked, stacked_specs,
                                                   shared, _split_micro(batch, accum))
                return {"loss_sum": ce, "tokens": n}

            def body(carry, micro):
                _, (ce, n, _) = _sums(spec.graphdef, params, micro, 0.0, cfg.data.reset_at_eod)
                return (carry[0] + ce, carry[1] + n), None
            (ce, n), _ = jax.lax.scan(body, (_f32zero(), _f32zero()), _split_micro(batch, accum))
            return {"loss_sum": ce, "tokens": n}

    return jax.jit(evaluate, in_shardings=(spec.param_shardings, batch_sharding(mesh, rules)))
