"""ZeRO-1/2 (``parallel.zero``): the optimizer state (1) and the gradients handed to the optimizer (2) sharded
over the ``data`` axis, the parameters still replicated over it (Megatron's distributed optimizer).

The rule is one sharding per parameter: the parameter's own (tensor, FSDP, stage, expert axes) with ``data``
added to the first dimension it divides after the splits already there; a parameter no dimension of which
divides is left replicated over data. In jaxtron's SPMD style the step is then sharding annotations: the
moments are created and kept in that sharding; with ZeRO-2 the gradient is constrained to it before the
optimizer, so XLA reduces it with a reduce-scatter over data instead of an all-reduce; the update runs on each
rank's shard, and the new parameters leave the step in their replicated-over-data sharding, an all-gather over
data of each updated parameter once per step (not per layer per micro batch as FSDP's weight gathers).
With ``fsdp > 1`` (hybrid sharding) the state is split over data on top of fsdp. With ``data = 1`` it changes
nothing.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.parallel.axes import DATA
from jaxtron.parallel.sharding import mesh_axes_of


def zero_sharding(sharding: NamedSharding, shape) -> NamedSharding:
    """``sharding`` (a parameter's) with the data axis added to the first dimension of ``shape`` it divides."""
    mesh = sharding.mesh
    size = mesh.shape.get(DATA, 1)
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if size == 1 or any(DATA in mesh_axes_of(e) for e in spec):
        return sharding
    for i, (dim, entry) in enumerate(zip(shape, spec)):
        split = math.prod(mesh.shape[a] for a in mesh_axes_of(entry))
        if dim % (split * size) == 0:
            spec[i] = mesh_axes_of(entry) + (DATA,)
            return NamedSharding(mesh, PartitionSpec(*spec))
    return sharding


def zero_shardings(param_shardings, params):
    """:func:`zero_sharding` of each parameter (``params``: arrays or ShapeDtypeStructs of the same tree)."""
    return jax.tree.map(lambda s, p: zero_sharding(s, p.shape), param_shardings, params)
