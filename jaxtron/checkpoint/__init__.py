"""Checkpoints: Orbax-managed, asynchronous, atomic, restorable onto any mesh (see ``manager.py``)."""

from jaxtron.checkpoint.manager import CheckpointError, Checkpointer, load_params, resolve_weights_path
from jaxtron.checkpoint.shards import CheckpointReadError

__all__ = ["CheckpointError", "CheckpointReadError", "Checkpointer", "load_params", "resolve_weights_path"]
