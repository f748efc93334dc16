"""Checkpoints: Orbax-managed, asynchronous, atomic, checksummed, restorable onto any mesh (see ``manager.py``);
``python -m jaxtron.checkpoint verify DIR`` checks one without restoring it."""

from jaxtron.checkpoint.integrity import CheckpointReadError, CheckpointWriteError, NonFiniteStateError
from jaxtron.checkpoint.manager import (CheckpointError, Checkpointer, load_params, nonfinite_leaves,
                                        resolve_weights_path)

__all__ = ["CheckpointError", "CheckpointReadError", "CheckpointWriteError", "Checkpointer", "NonFiniteStateError",
           "load_params", "nonfinite_leaves", "resolve_weights_path"]
