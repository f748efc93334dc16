"""Checkpoints: Orbax-managed, asynchronous, atomic, checksummed, restorable onto any mesh (see ``manager.py``);
``python -m jaxtron.checkpoint verify DIR`` checks one without restoring it."""

from jaxtron.jax_startup import import_jax

import_jax()  # before this package imports JAX: quiet on a machine without a GPU

from jaxtron.checkpoint.integrity import CheckpointReadError, CheckpointWriteError, NonFiniteStateError
from jaxtron.checkpoint.manager import (CheckpointError, Checkpointer, load_params, nonfinite_leaves,
                                        resolve_weights_path)

__all__ = ["CheckpointError", "CheckpointReadError", "CheckpointWriteError", "Checkpointer", "NonFiniteStateError",
           "load_params", "nonfinite_leaves", "resolve_weights_path"]
