"""Build the device mesh from ``parallel.*``."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtron.config import MESH_AXES, Config, ConfigError, ParallelConfig, resolve_mesh_shape

# Outermost first: data and stage span hosts, tensor (then fsdp) stay innermost, inside a node.
MESH_ORDER = ("stage", "data", "fsdp", "tensor")


def _hybrid_mesh(shape: tuple[int, ...], devices) -> np.ndarray:
    """Nodes (processes) split the outer axes (stage, then data, then fsdp); each node's devices fill the rest,
    so tensor parallelism (and as much FSDP as fits) stays on NVLink."""
    remaining, dcn = jax.process_count(), []
    for size in shape:
        g = math.gcd(size, remaining)
        dcn.append(g)
        remaining //= g
    if remaining != 1:
        raise ConfigError("parallel", f"mesh stage*data*fsdp*tensor = {'*'.join(map(str, shape))} cannot be split "
                                      f"over {jax.process_count()} processes (nodes)")
    ici = tuple(s // d for s, d in zip(shape, dcn))
    return mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn), devices, process_is_granule=True,
                                                allow_split_physical_axes=True)


def build_mesh(parallel: ParallelConfig | Config, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A mesh with axes ('stage', 'data', 'fsdp', 'tensor') over ``devices`` (default: all devices), sized by
    ``parallel`` (a whole :class:`~jaxtron.config.Config` or its ``parallel`` section; one axis may be -1).

    Axes are ``AxisType.Auto`` (GSPMD/Shardy propagation plus logical constraints)."""
    if isinstance(parallel, Config):
        parallel = parallel.parallel
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(parallel, len(devices))
    shape = tuple(sizes[a] for a in MESH_ORDER)
    assert set(MESH_ORDER) == set(MESH_AXES)
    if jax.process_count() > 1 and devices == list(jax.devices()) and devices[0].platform != "cpu":
        dev_array = _hybrid_mesh(shape, devices)
    elif devices == list(jax.devices()) and devices[0].platform != "cpu":
        # Topology-aware order on accelerators (NVLink/ICI neighbours on the inner axes).
        dev_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        dev_array = np.asarray(devices).reshape(shape)
    return Mesh(dev_array, MESH_ORDER, axis_types=(AxisType.Auto,) * len(MESH_ORDER))
