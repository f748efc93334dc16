"""Ahead-of-time lowering of the real train step on abstract shapes: nothing is allocated."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxtron.config import Config
from jaxtron.parallel.layout import Layout
from jaxtron.train.optimizer import make_optimizer
from jaxtron.train.state import abstract_train_state
from jaxtron.train.step import BATCH_KEYS, batch_sharding, make_train_step


def abstract_batch(cfg: Config, sharding) -> dict:
    shape = (cfg.train.global_batch_size, cfg.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=sharding)
            for k in BATCH_KEYS}


def lower_train_step_with_spec(cfg: Config, devices: Optional[Sequence[jax.Device]] = None):
    """(lowered train step, abstract state spec, layout) for ``cfg`` on ``devices``."""
    layout = Layout.build(cfg, devices)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    spec = abstract_train_state(cfg, tx, layout)
    step = make_train_step(cfg, spec, tx, schedule, layout)
    lowered = step.trace(spec.abstract_state, abstract_batch(cfg, batch_sharding(layout))).lower()
    return lowered, spec, layout


def lower_train_step(cfg: Config, devices: Optional[Sequence[jax.Device]] = None) -> jax.stages.Lowered:
    """``jax.jit(train_step).trace(abstract state, abstract batch).lower()`` for ``cfg`` on ``devices``."""
    return lower_train_step_with_spec(cfg, devices)[0]
