"""Flax NNX Llama-family models. Model code names logical axes only; jaxtron.parallel maps them to a mesh.

Names are imported on first use, so ``jaxtron.model.kernels.check`` (config validation) does not import JAX."""

import importlib

_EXPORTS = {"Llama": "jaxtron.model.llama", "DecoderBlock": "jaxtron.model.llama"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxtron.model' has no attribute {name!r}")
