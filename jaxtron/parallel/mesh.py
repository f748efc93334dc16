"""Build the device mesh: :class:`~jaxtron.parallel.layout.Layout` decides the sizes, this places devices."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtron.config.schema import ConfigError


def _hybrid_mesh(shape: tuple[int, ...], axes: Sequence[str], devices) -> np.ndarray:
    """Nodes (processes) split the outer axes first; each node's devices fill the rest, so tensor parallelism
    (and as much FSDP as fits) stays on NVLink."""
    remaining, dcn = jax.process_count(), []
    for size in shape:
        g = math.gcd(size, remaining)
        dcn.append(g)
        remaining //= g
    if remaining != 1:
        raise ConfigError("parallel", f"mesh {'*'.join(axes)} = {'*'.join(map(str, shape))} cannot be split "
                                      f"over {jax.process_count()} processes (nodes)")
    ici = tuple(s // d for s, d in zip(shape, dcn))
    return mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn), devices, process_is_granule=True,
                                                allow_split_physical_axes=True)


def mesh_for(shape: Sequence[int], axes: Sequence[str], devices: Sequence[jax.Device]) -> Mesh:
    """An ``AxisType.Auto`` mesh (GSPMD/Shardy propagation plus logical constraints) of ``shape`` over
    ``devices``: topology-aware on accelerators, in the given order on CPUs."""
    devices, shape = list(devices), tuple(shape)
    if jax.process_count() > 1 and devices == list(jax.devices()) and devices[0].platform != "cpu":
        dev_array = _hybrid_mesh(shape, axes, devices)
    elif devices == list(jax.devices()) and devices[0].platform != "cpu":
        # Topology-aware order on accelerators (NVLink/ICI neighbours on the inner axes).
        dev_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
