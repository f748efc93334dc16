"""The pure, jitted train and eval steps (state buffers donated), with gradient accumulation inside."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtron.config import Config, micro_batch_size
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


def _sums(graphdef, params, batch, z_loss: float):
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    ce, z, n = cross_entropy_sums(logits, batch["targets"], batch["loss_mask"], z_loss)
    return ce + z, (ce, n)


def make_train_step(cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation, schedule: Callable,
                    mesh: Mesh, rules, dp: int):
    accum = accumulation_steps(cfg, dp)
    z_loss = cfg.optim.z_loss
    grad_fn = jax.value_and_grad(lambda p, b: _sums(spec.graphdef, p, b, z_loss), has_aux=True)

    def step(state, batch):
        with use_rules(rules, mesh):
            params = state["params"]
            if accum == 1:
                (_, (ce, n)), grads = grad_fn(params, batch)
            else:
                def body(carry, micro):
                    g_acc, ce_acc, n_acc = carry
                    (_, (ce, n)), g = grad_fn(params, micro)
                    return (jax.tree.map(jnp.add, g_acc, g), ce_acc + ce, n_acc + n), None

                zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s),
                                     params, spec.param_shardings)
                (grads, ce, n), _ = jax.lax.scan(body, (zeros, _f32zero(), _f32zero()), _split_micro(batch, accum))
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
                       "skipped": jnp.logical_not(ok)}
            return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    return jax.jit(step, in_shardings=(spec.state_shardings, batch_sharding(mesh, rules)),
                   out_shardings=(spec.state_shardings, None), donate_argnums=(0,))


def make_eval_step(cfg: Config, spec: ModelSpec, mesh: Mesh, rules, dp: int):
    accum = accumulation_steps(cfg, dp)

    def evaluate(params, batch):
        with use_rules(rules, mesh):
            def body(carry, micro):
                _, (ce, n) = _sums(spec.graphdef, params, micro, 0.0)
                return (carry[0] + ce, carry[1] + n), None
            (ce, n), _ = jax.lax.scan(body, (_f32zero(), _f32zero()), _split_micro(batch, accum))
            return {"loss_sum": ce, "tokens": n}

    return jax.jit(evaluate, in_shardings=(spec.param_shardings, batch_sharding(mesh, rules)))
