"""Build the device mesh from ``parallel.*``."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtron.config import MESH_AXES, ParallelConfig, resolve_mesh_shape

# Outermost first: data and stage span hosts, tensor (then fsdp) stay innermost, inside a node.
MESH_ORDER = ("stage", "data", "fsdp", "tensor")


def build_mesh(parallel: ParallelConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A mesh with axes ('stage', 'data', 'fsdp', 'tensor') over ``devices`` (default: all devices).

    Axes are ``AxisType.Auto`` (GSPMD/Shardy propagation plus logical constraints)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(parallel, len(devices))
    shape = tuple(sizes[a] for a in MESH_ORDER)
    assert set(MESH_ORDER) == set(MESH_AXES)
    if devices == list(jax.devices()) and devices[0].platform != "cpu":
        # Topology-aware order on accelerators (NVLink/ICI neighbours on the inner axes).
        dev_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, MESH_ORDER, axis_types=(AxisType.Auto,) * len(MESH_ORDER))
