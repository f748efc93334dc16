"""The token-embedding lookup under a mesh: each device looks up its own tokens.

``jnp.take(table, tokens)`` left to GSPMD partitions well in the forward (the table gathered over its FSDP
shards, vocab still split over tensor), but its transpose, a scatter-add of the cotangents into the table's
gradient, can be partitioned by all-gathering the cotangents of the whole micro batch onto every device:
in DeepSeek-V3's plan on 1,024 H100s (pipeline stages, sequence parallelism, expert 64) a bf16
[256, 4096, 7168] all-gather (15 GB) per micro batch, twice (the embedding and the MTP module's lookup), 49
of the 379 s step and 12 GiB of its peak (docs/moe.md, "DeepSeek-V3 on 1,024 H100 (planner)").

:func:`lookup` runs the lookup in a ``jax.shard_map`` that is manual over the axes that split the tokens (the
batch axes, ``act_batch``, and the sequence's context axis, ``act_seq``): the table enters replicated over
them, every device gathers its own tokens' rows (tensor stays automatic, so the vocab-parallel lookup is
GSPMD's as before), and the transpose scatters each device's cotangents into its own copy of the table's
gradient and sums those over those axes (one all-reduce of the table's tensor shard, which XLA may turn into
the reduce-scatter onto the FSDP shards: Llama-3-8B on 16 H100s at fsdp 16 compiles to the same collectives
as before).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtron.parallel.sharding import constrain, current_context, devices_are_cpu, logical_to_spec, mesh_axes_of


# False inside :func:`gspmd_lookup`
_PER_DEVICE = contextvars.ContextVar("jaxtron_embedding_per_device", default=True)


@contextlib.contextmanager
def gspmd_lookup():
    """Within: :func:`lookup` leaves the lookup to GSPMD (``jnp.take``). The gpipe/circular pipelines embed
    every micro batch before their tick loop, outside the stage ``shard_map``; there, under tensor x sequence
    parallelism, XLA's SPMD partitioner aborts on the per-device lookup's gather (``PartitionGather``:
    partition_group_list check; 1f1b, which embeds inside the stage ``shard_map``, compiles)."""
    token = _PER_DEVICE.set(False)
    try:
        yield
    finally:
        _PER_DEVICE.reset(token)


def lookup(table: jax.Array, tokens: jax.Array, dtype, table_names) -> jax.Array:
    """Rows of ``table`` [vocab, hidden] at ``tokens`` [batch, seq], in ``dtype``: [batch, seq, hidden]. The
    table is constrained to the logical ``table_names`` first (the embedding: gathered over FSDP, vocab over
    tensor). Under a mesh whose batch or context axes split ``tokens``, per device (module doc); else
    ``jnp.take``."""
    ctx = current_context() if _PER_DEVICE.get() else None
    mesh = ctx[1] if ctx is not None else None
    batch, seq = (tuple(mesh_axes_of(logical_to_spec((name,), ctx[0])[0], mesh) for name in ("act_batch", "act_seq"))
                  if mesh is not None else ((), ()))
    seq = tuple(a for a in seq if a not in batch)  # rules may put both on one axis: it splits the batch then
    n_batch, n_seq = (math.prod(mesh.shape[a] for a in axes) if axes else 1 for axes in (batch, seq))
    if n_batch * n_seq == 1 or tokens.shape[0] % n_batch or tokens.shape[1] % n_seq:
        return jnp.take(constrain(table.astype(dtype), table_names), tokens, axis=0)
    # GPUs: cast before the boundary, so that the gather and the transpose's sum move the compute dtype (half
    # the bytes); XLA:CPU aborts on a bf16 all-reduce there (as in parallel/expert.py): on CPUs cast inside
    if not devices_are_cpu():
        table = table.astype(dtype)
    body = lambda t, ids: jnp.take(t.astype(dtype), ids, axis=0)  # noqa: E731
    ids = P(batch or None, seq or None)
    # check_vma=False: the output is split over every manual axis, so the transpose sums exactly the table's
    # cotangent over them (as parallel/expert.py's dispatch)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), ids), out_specs=ids,
                           axis_names=frozenset(batch + seq), check_vma=False)
    return mapped(constrain(table, table_names), tokens)
