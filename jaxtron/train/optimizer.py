"""AdamW (or Muon, :mod:`jaxtron.train.muon`) with warmup + cosine / linear / warmup-stable-decay schedules,
global-norm clipping, and no weight decay on norms and biases."""

from __future__ import annotations

from typing import Optional

import jax
import optax

from jaxtron.config import OptimConfig
from jaxtron.train.muon import muon

# RMSNorm scales, QKV biases, and MoE's aux-free expert bias (moved by the train step, not by the optimizer:
# its gradient is zero, so without decay AdamW leaves it exactly as it is)
NO_DECAY_NAMES = ("scale", "bq", "bk", "bv", "expert_bias")


def learning_rate_schedule(o: OptimConfig, total_steps: int) -> optax.Schedule:
    peak, floor = o.lr, o.lr * o.min_lr_ratio
    warmup = min(o.warmup_steps, total_steps)
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if o.schedule == "constant":
        return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
    if o.schedule == "wsd":
        decay = o.decay_steps if o.decay_steps is not None else max(1, int(0.2 * total_steps))
        stable = max(total_steps - warmup - decay, 0)
        return optax.join_schedules(
            [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, max(decay, 1))],
            [warmup, warmup + stable])
    decay = o.decay_steps if o.decay_steps is not None else max(total_steps - warmup, 1)
    if o.schedule == "cosine":
        tail = optax.cosine_decay_schedule(peak, max(decay, 1), alpha=o.min_lr_ratio)
    else:  # linear
        tail = optax.linear_schedule(peak, floor, max(decay, 1))
    return optax.join_schedules([warm, tail], [warmup])


def decay_mask(params):
    """True for weights that get weight decay: everything but norm scales and biases."""

    def keep(path, _):
        name = getattr(path[-1], "key", getattr(path[-1], "name", str(path[-1])))
        return name not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(o: OptimConfig, total_steps: int,
                   names: Optional[dict] = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer of ``optim`` and its schedule. Muon needs ``names``, the params' logical axis names
    (:func:`jaxtron.train.state.param_names`), to tell the hidden matrices and their fan-in/out axes."""
    schedule = learning_rate_schedule(o, total_steps)
    parts = []
    if o.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(o.grad_clip))
    adam = optax.adamw(schedule, b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if o.name == "muon":
        if names is None:
            raise ValueError("optim.name=muon: make_optimizer needs the params' logical names")
        parts.append(muon(o, schedule, names, adam))
    else:
        parts.append(adam)
    return optax.chain(*parts), schedule
