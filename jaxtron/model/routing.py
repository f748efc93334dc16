"""MoE routing: router scores in fp32, (grouped) top-k, the load-balancing and z losses, and the
auxiliary-loss-free expert bias (DeepSeek-V3) with its update.

Everything here works on flattened tokens ``[T, ...]`` and is plain ``jnp``: under GSPMD the sums over
tokens are global over the (micro) batch however the tokens are sharded, so the losses and loads of a sharded
run equal those of one device.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.model_schema import MoEConfig

BIAS_NAME = "expert_bias"  # the parameter key of the aux-free bias (the train step finds it by this name)


class ExpertBias(nnx.Variable):
    """DeepSeek-V3's per-expert selection bias: model state (saved and restored with the params) that no
    gradient reaches; the train step moves it from the expert load (:func:`update_expert_bias`)."""


class Routing(NamedTuple):
    experts: jax.Array   # [T, k] int32: the chosen experts of each token
    weights: jax.Array   # [T, k] fp32: their combine weights
    probs: jax.Array     # [T, E] fp32: per-token distribution over experts for the load-balancing loss
    logits: jax.Array    # [T, E] fp32: the router logits (z-loss)


def _grouped_mask(select: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """DeepSeek-V3's group-limited routing: a group scores the sum of its best two experts; experts outside a
    token's best ``topk_group`` groups are masked to -inf."""
    t, e = select.shape
    groups = select.reshape(t, n_group, e // n_group)
    group_score = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)              # [T, G]
    _, best = jax.lax.top_k(group_score, topk_group)                         # [T, topk_group]
    keep = jnp.sum(jax.nn.one_hot(best, n_group, dtype=jnp.int32), axis=1) > 0  # [T, G]
    keep = jnp.repeat(keep, e // n_group, axis=1)
    return jnp.where(keep, select, -jnp.inf)


def route(x: jax.Array, router: jax.Array, cfg: MoEConfig, bias: Optional[jax.Array] = None) -> Routing:
    """x: [T, D] tokens, router: [D, E]. The matmul and the scores are fp32 (small differences in router
    logits flip expert choices, so they are not left to bf16). ``bias`` [E] (aux-free balancing) shifts the
    scores used to *choose* experts only; the combine weights are the unbiased scores."""
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), router.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    if cfg.score_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    select = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if cfg.n_group > 1:
        select = _grouped_mask(select, cfg.n_group, cfg.topk_group)
    _, experts = jax.lax.top_k(select, cfg.num_experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return Routing(experts.astype(jnp.int32), weights, probs, logits)


def expert_load(experts: jax.Array, num_experts: int) -> jax.Array:
    """[T, k] expert ids -> fp32 [E]: assignments per expert (no gradient)."""
    return jnp.sum(jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.float32), axis=0)


def load_balancing_loss(r: Routing, load: jax.Array) -> jax.Array:
    """Switch / Mixtral: E * sum_e f_e * P_e, f_e the fraction of assignments that went to expert e and P_e
    the mean router probability of e, both over all tokens of the batch. 1 when balanced; the gradient flows
    through P only (f is a count)."""
    e = load.shape[0]
    f = load / jnp.maximum(jnp.sum(load), 1.0)
    p = jnp.mean(r.probs, axis=0)
    return e * jnp.sum(jax.lax.stop_gradient(f) * p)


def router_z_loss(r: Routing) -> jax.Array:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(router logits)^2."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))


def update_expert_bias(params: dict, load: jax.Array, rate: float) -> dict:
    """DeepSeek-V3's bias update: bias_e += rate * sign(mean load - load_e) for every MoE layer. ``params`` is
    the pure params dict; its aux-free biases are the ``expert_bias`` leaves, each [L, E] for the L MoE layers
    of its stack, and ``load`` is [num MoE layers, E] in the same order (only the ``layers`` stack holds MoE
    layers, one per scanned unit)."""
    def upd(path, leaf):
        if getattr(path[-1], "key", None) != BIAS_NAME:
            return leaf
        err = jnp.mean(load, axis=-1, keepdims=True) - load
        return (leaf + rate * jnp.sign(err)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(upd, params)


def layer_terms(stats: Optional[dict], n: jax.Array, cfg: MoEConfig, num_moe_layers: int
                ) -> tuple[jax.Array, dict]:
    """What some MoE layers add to a micro batch's loss: ``(objective term, report)``. ``stats`` are the
    layers' router stats (leading [layers] axis; None: no MoE layer, zero and {}), ``n`` the micro batch's
    token count. The objective adds n * (aux_coef * aux + z_coef * z) with aux and z means over all
    ``num_moe_layers`` MoE layers, so the terms of a subset of layers (a pipeline stage's) add up to the whole
    model's. The report keeps the leading [layers] axis (no gradient): ``moe_aux_loss``/``moe_z_loss`` (those
    means' per-layer shares times n), ``moe_load`` [layers, E], ``moe_dropped``/``moe_assigned``."""
    if stats is None:
        return jnp.zeros((), jnp.float32), {}
    share = n / num_moe_layers
    aux, z = stats["aux_loss"] * share, stats["z_loss"] * share
    objective = cfg.aux_loss_coef * jnp.sum(aux) + cfg.z_loss_coef * jnp.sum(z)
    report = {"moe_aux_loss": aux, "moe_z_loss": z, "moe_load": stats["load"], "moe_dropped": stats["dropped"],
              "moe_assigned": stats["assigned"]}
    return objective, jax.tree.map(jax.lax.stop_gradient, report)


def report_sums(report: dict) -> dict:
    """:func:`layer_terms`' report of all the MoE layers -> the step's aux sums: scalars summed over layers,
    ``moe_load`` kept per layer [layers, E] (the aux-free bias update needs it)."""
    return {k: v if k == "moe_load" else jnp.sum(v) for k, v in report.items()}


def step_metrics(aux: dict, n: jax.Array) -> tuple[dict, Optional[jax.Array]]:
    """The train step's MoE metrics from the summed aux entries of the loss (see jaxtron.train.step):
    ``moe_aux_loss`` and ``moe_z_loss`` (means over MoE layers and tokens, before their coefficients),
    ``moe_load_max_over_mean`` (the worst MoE layer's max/mean assignments per expert over the whole step's
    batch) and ``moe_dropped`` (fraction of assignments dropped by capacity dispatch). Returns (metrics, the
    [layers, E] load) and passes non-MoE entries through divided by the token count."""
    out, load = {}, None
    for k, v in aux.items():
        if k == "moe_load":
            load = v
            mean = jnp.maximum(jnp.mean(v, axis=-1), 1e-9)
            out["moe_load_max_over_mean"] = jnp.max(jnp.max(v, axis=-1) / mean)
        elif k == "moe_dropped":
            out[k] = v / jnp.maximum(aux["moe_assigned"], 1.0)
        elif k != "moe_assigned":
            out[k] = v / n
    return out, load
