"""The only package that knows the device mesh: the Layout, mesh building, the logical-axis rules, sharding
helpers, and the code that needs mesh axes by name (pipeline stages, ring/Ulysses attention, expert dispatch).

Names are imported on first use, so config validation (``layout.check_parallel``) does not import JAX."""

import importlib

_EXPORTS = {
    "Layout": "jaxtron.parallel.layout",
    "build_mesh": "jaxtron.parallel.mesh",
    "logical_rules": "jaxtron.parallel.rules",
    "constrain": "jaxtron.parallel.sharding",
    "logical_to_sharding": "jaxtron.parallel.sharding",
    "use_rules": "jaxtron.parallel.sharding",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxtron.parallel' has no attribute {name!r}")
