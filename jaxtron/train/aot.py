"""Ahead-of-time lowering of the real train step on abstract shapes: nothing is allocated."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxtron import config as config_lib
from jaxtron.config import Config
from jaxtron.parallel import build_mesh, logical_rules
from jaxtron.train.optimizer import make_optimizer
from jaxtron.train.state import abstract_train_state
from jaxtron.train.step import BATCH_KEYS, batch_sharding, make_train_step


def abstract_batch(cfg: Config, sharding) -> dict:
    shape = (cfg.train.global_batch_size, cfg.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=sharding)
            for k in BATCH_KEYS}


def lower_train_step_with_spec(cfg: Config, devices: Optional[Sequence[jax.Device]] = None):
    """(lowered train step, abstract state spec, mesh, mesh sizes) for ``cfg`` on ``devices``."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = config_lib.validate_for_devices(cfg, len(devices), devices[0].platform)
    mesh = build_mesh(cfg.parallel, devices)
    rules = logical_rules(cfg.parallel)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    spec = abstract_train_state(cfg, tx, mesh, rules)
    step = make_train_step(cfg, spec, tx, schedule, mesh, rules, sizes["data"] * sizes["fsdp"])
    lowered = step.trace(spec.abstract_state, abstract_batch(cfg, batch_sharding(mesh, rules))).lower()
    return lowered, spec, mesh, sizes


def lower_train_step(cfg: Config, devices: Optional[Sequence[jax.Device]] = None) -> jax.stages.Lowered:
    """``jax.jit(train_step).trace(abstract state, abstract batch).lower()`` for ``cfg`` on ``devices``."""
    return lower_train_step_with_spec(cfg, devices)[0]
