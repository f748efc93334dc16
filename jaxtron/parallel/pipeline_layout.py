"""How a pipelined step lays out over the ``stage`` mesh axis, shared by the schedules (:mod:`fill_drain`:
gpipe/circular; :mod:`one_f_one_b`): the :class:`PipelineSpec` (sizes, ticks, bubble), the stacked weights
regrouped into per-stage chunks and back, the ``shard_map`` the pipelined region runs in, and the log of the
activation memory a schedule keeps.

The pipelined region is a ``jax.shard_map`` that is manual over ``stage`` only, so data, FSDP and tensor
parallelism keep working inside each stage (those axes stay automatic; :func:`in_stage_rules`). Micro batches
move between stages with ``ppermute``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtron.parallel.axes import CONTEXT, FSDP, STAGE
from jaxtron.parallel.sharding import use_rules
from jaxtron.parallel.zero_bubble_v_table import zbv_table

AXIS = STAGE  # the axis the pipelined region is manual over
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSpec:
    stages: int
    micro_batches: int
    schedule: str = "1f1b"      # '1f1b' | 'gpipe' | 'circular' | 'zb_h1' | 'zbv'
    virtual_stages: int = 1     # circular only
    gather_fsdp: bool = False   # gather the stage's weights over 'fsdp' once per step, not per tick
    recompute: bool = False     # keep only each tick's stage input and run the stage's forward again in its backward

    @property
    def chunks_per_device(self) -> int:
        return self.virtual_stages if self.schedule == "circular" else 2 if self.schedule == "zbv" else 1

    @property
    def ticks(self) -> int:
        s, m, v = self.stages, self.micro_batches, self.chunks_per_device
        if self.schedule == "zbv":  # ticks of one chunk's F, B or W each
            return zbv_table(s, m).ticks
        return m + 2 * s - 2 if self.schedule in ("1f1b", "zb_h1") else v * m + s - 1

    @property
    def bubble(self) -> float:
        """Idle fraction: (S-1)/(V*M+S-1) (V = 1 but for circular; 1f1b's fill and drain ticks run only a
        forward or only a backward, so its M + 2S - 2 ticks last as long as M + S - 1 full ones); zb_h1's
        (S-1)/(3M+S-1), with F, B and W one unit each (:func:`jaxtron.parallel.zero_bubble.zb_h1_table`); zbv's
        from its table (:func:`jaxtron.parallel.zero_bubble_v_table.zbv_table`)."""
        s, m, v = self.stages, self.micro_batches, self.chunks_per_device
        if self.schedule == "zbv":
            return zbv_table(s, m).bubble
        if self.schedule == "zb_h1":
            return (s - 1) / (3 * m + s - 1)
        return (s - 1) / (v * m + s - 1)


def nbytes(tree: Any) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def log_memory(spec: PipelineSpec, slots: int, slot_bytes: int, what: str, unit: str = "micro batches") -> None:
    """The activation memory the schedule keeps between a micro batch's forward and backward, logged when the
    step is traced (at start-up). Sizes are per stage: a stage's data, FSDP and tensor devices split them.
    ``unit``: what one slot holds (zbv's hold one chunk of one micro batch)."""
    mib = 2.0 ** 20
    log.info("pipeline %s: %d stages, %d micro batches, bubble %.1f%%; keeps %s of %d %s per stage: "
             "%d x %.2f MiB = %.1f MiB (split over the stage's devices)%s", spec.schedule, spec.stages,
             spec.micro_batches, 100 * spec.bubble, what, slots, unit, slots, slot_bytes / mib,
             slots * slot_bytes / mib,
             "; parallel.pipeline_recompute runs each stage forward twice" if spec.recompute else "")


# ------------------------------------------------------------------------------------------------ layout


def chunked(stacked: Any, stacked_specs: Any, spec: PipelineSpec, mesh: Mesh) -> Any:
    """[L, ...] leaves (contiguous per stage) -> [S, V, L/(S*V), ...], device s holding chunks s, s+S, ...; under
    zbv (V = 2) chunks s and 2S - 1 - s (the V).

    With V = 1 this is a local reshape (no data moves); with V > 1 it regroups the layers across stages. With
    ``spec.gather_fsdp`` the ``fsdp`` axis is dropped from the weights' sharding here, once per step (an
    all-gather; the gradients are reduce-scattered once in return), instead of in every tick of the loop."""
    s, v = spec.stages, spec.chunks_per_device
    gathered = (FSDP, CONTEXT) if spec.gather_fsdp else ()  # ZeRO-3 spans both (rules.py)

    def drop(entry):
        if entry is None or isinstance(entry, str):
            return None if entry in gathered else entry
        kept = tuple(a for a in entry if a not in gathered)
        return kept or None

    def one(w, pspec):
        n = w.shape[0]
        rest = tuple(drop(e) for e in tuple(pspec)[1:]) + (None,) * (w.ndim - len(tuple(pspec)))
        if v == 1:
            w = w.reshape(s, 1, n // s, *w.shape[1:])
        elif spec.schedule == "zbv":  # the down leg's chunks in order, the up leg's reversed
            w = w.reshape(2, s, n // (2 * s), *w.shape[1:])
            w = jnp.stack([w[0], jnp.flip(w[1], 0)], axis=1)
        else:  # chunk c = r * S + stage holds layers [c * Lc, (c + 1) * Lc)
            w = w.reshape(v, s, n // (s * v), *w.shape[1:]).swapaxes(0, 1)
        return lax.with_sharding_constraint(w, NamedSharding(mesh, P(AXIS, None, None, *rest)))

    return jax.tree.map(one, stacked, stacked_specs)


def unchunked(chunks: Any, spec: PipelineSpec) -> Any:
    """Inverse of :func:`chunked` (for gradients)."""
    v = spec.chunks_per_device

    def one(w):
        if spec.schedule == "zbv":
            w = jnp.stack([w[:, 0], jnp.flip(w[:, 1], 0)])
        elif v > 1:
            w = w.swapaxes(0, 1)
        return w.reshape(-1, *w.shape[3:])

    return jax.tree.map(one, chunks)


def tree_index(tree: Any, i) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def stage_specs(tree: Any) -> Any:
    return jax.tree.map(lambda _: P(AXIS), tree)


def replicated(tree: Any) -> Any:
    return jax.tree.map(lambda _: P(), tree)


def stage_shard_map(fn, mesh: Mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset({AXIS}),
                         check_vma=False)


def in_stage_rules(fn: Callable, rules) -> Callable:
    """Inside the shard_map, constraints name the automatic axes through the context (partly manual) mesh."""
    @functools.wraps(fn)
    def wrapped(*args):
        with use_rules(rules, None):
            return fn(*args)
    return wrapped


def side_zeros(stage: Callable, local: Any, x: jax.Array, mb: dict, chunks: int):
    """Zeros shaped like ``stage``'s side output ``(objective term, per-layer report)``, and like the report
    of all ``chunks`` chunks ([chunks, Lc, ...] per leaf)."""
    obj, report = jax.eval_shape(lambda: stage(local, x, mb)[1])
    zeros = lambda a, lead=(): jnp.zeros(lead + a.shape, a.dtype)
    return (zeros(obj), jax.tree.map(zeros, report)), jax.tree.map(lambda a: zeros(a, (chunks,)), report)


def layer_order(report: Any) -> Any:
    """[chunks, Lc, ...] -> [L, ...]: chunk c holds layers [c * Lc, (c + 1) * Lc) (see :func:`chunked`)."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), report)

