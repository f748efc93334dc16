"""Ahead-of-time lowering of the real train step on abstract shapes: nothing is allocated."""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from jaxtron.config import Config
from jaxtron.train.program import build_program


def lower_train_step_with_spec(cfg: Config, devices: Optional[Sequence[jax.Device]] = None):
    """(lowered train step, abstract state spec, layout) for ``cfg`` on ``devices``."""
    program = build_program(cfg, devices)
    return program.lower_train_step(), program.spec, program.layout


def lower_train_step(cfg: Config, devices: Optional[Sequence[jax.Device]] = None) -> jax.stages.Lowered:
    """``jax.jit(train_step).trace(abstract state, abstract batch).lower()`` for ``cfg`` on ``devices``."""
    return build_program(cfg, devices).lower_train_step()
