"""The program a config describes: its layout on the devices, the abstract (sharded) train state, the optimizer
and its schedule, and the jitted train and eval steps. :func:`build_program` is the one place they are put
together; the :class:`~jaxtron.train.trainer.Trainer` runs it, ``jaxtron.train.aot`` and the planner
(``python -m jaxtron.plan``) lower it ahead of time, so all three compile the same program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxtron import preflight
from jaxtron.config import Config
from jaxtron.parallel.layout import Layout
from jaxtron.train.optimizer import make_optimizer
from jaxtron.train.state import ModelSpec, abstract_train_state, param_names
from jaxtron.train.step import BATCH_KEYS, batch_sharding, make_eval_step, make_gradients, make_train_step


@dataclass(frozen=True)
class Program:
    """What runs on the devices for ``cfg``; nothing in it is allocated."""

    cfg: Config
    devices: tuple
    layout: Layout
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    spec: ModelSpec              # graph, shardings and abstract state ``{"step", "params", "opt_state"}``
    train_step: Any              # jitted (state, batch) -> (state, metrics); the state's buffers are donated
    eval_step: Any               # jitted (params, batch) -> {"loss_sum", "tokens"}
    batch_sharding: NamedSharding
    loss_fn: Optional[Callable] = None  # a custom loss(model, batch) -> (loss_sum, aux), or the built-in

    def abstract_batch(self) -> dict:
        """The global batch's shapes, dtypes and sharding."""
        shape = (self.cfg.train.global_batch_size, self.cfg.data.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                        sharding=self.batch_sharding) for k in BATCH_KEYS}

    def lower_train_step(self) -> jax.stages.Lowered:
        """The train step lowered on the abstract state and batch (ahead of time: nothing is allocated)."""
        return self.train_step.trace(self.spec.abstract_state, self.abstract_batch()).lower()

    def gradients_step(self):
        """Jitted ``(params, batch) -> (grads, metrics)``: the gradient the train step hands the optimizer."""
        return make_gradients(self.cfg, self.spec, self.layout, self.batch_sharding, self.loss_fn)


def build_program(cfg: Config, devices: Optional[Sequence[jax.Device]] = None, *,
                  loss_fn: Optional[Callable] = None) -> Program:
    """The :class:`Program` of ``cfg`` on ``devices`` (default: all); raises ``ConfigError`` when the config
    cannot run on them (the layout's and the preflight checks)."""
    devices = tuple(devices if devices is not None else jax.devices())
    layout = Layout.build(cfg, list(devices))
    preflight.check(cfg, layout)
    names = param_names(cfg) if cfg.optim.name == "muon" else None  # Muon tells the matrices by their axes
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, names)
    spec = abstract_train_state(cfg, tx, layout)
    return Program(cfg=cfg, devices=devices, layout=layout, tx=tx, schedule=schedule, spec=spec,
                   train_step=make_train_step(cfg, spec, tx, schedule, layout, loss_fn=loss_fn),
                   eval_step=make_eval_step(cfg, spec, layout), batch_sharding=batch_sharding(layout),
                   loss_fn=loss_fn)
