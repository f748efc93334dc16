"""Collective matmul (``parallel.tp_comm_overlap``): tensor/sequence-parallel communication overlapped with the
projections' GEMMs, as Megatron's TP communication overlap and MaxText's collective matmul do.

Under sequence parallelism (``parallel.sequence_parallel``) the residual stream's sequence (``act_res_seq``) is
split over ``tensor``. A projection that reads the residual stream (its weight contracts ``embed``) and writes
a tensor-split axis (``heads``, ``kv_heads``, ``mlp``: Q/K/V, gate/up) needs the whole sequence: GSPMD gathers
it, then multiplies. A projection that writes the residual stream (its weight's output axis is ``embed``:
attention out, down) contracts a tensor-split axis: GSPMD multiplies, then reduce-scatters the partial sums over
the sequence. Each collective sits between two GEMMs that depend on it, exposed.

:func:`projects` runs such projections in a ``jax.shard_map`` manual over ``tensor`` only (data, FSDP and the
other mesh axes stay automatic) as T = tensor ring steps:

* all-gather + GEMM (column-parallel), x [b, s/T, d] @ w [d, n/T] -> [b, s, n/T]: at step i a device
  multiplies the sequence chunk it holds (its own at step 0) while ``ppermute`` passes that chunk on to the
  next rank; the T results are written into the output at their chunks' places.
* GEMM + reduce-scatter (row-parallel), h [b, s, n/T] @ w [n/T, d] -> [b, s/T, d]: at step i a device
  multiplies the chunk of h whose partial sum is passed to it, adds it to the sum that arrived, and passes the
  sum on; after T steps each device holds the complete sum of its own chunk.

Each step's GEMM does not wait on the transfer issued beside it, so XLA:GPU's latency-hiding scheduler can run
the async collective-permute under it. Left alone it does not: it puts every chunk's GEMM under the last
transfer of the chain and leaves the others exposed back to back (seen in the compiled 70B module). An
``optimization_barrier`` per step pins each GEMM between its own transfer's start and the next one's.

The backward is JAX's transpose of the same program: the transpose of a ``ppermute`` is the reverse
``ppermute``, so the all-gather ring's input gradient is a reduce-scatter ring of chunk GEMMs and the
reduce-scatter ring's an all-gather ring (the weight gradients are per-chunk GEMMs summed locally, no
communication); the compiled module holds those reverse rings' collective-permutes.

The decision is made here, from the logical names of the weight and the rules, never from the model: a
projection that does not match one of the two shapes, a sequence that does not split into T chunks (decoding),
a sequence also split over ``context``, a projection inside a pipeline stage (:func:`plan` says why), or an
FP8 recipe (per-chunk quantization would change the scales; logged once) takes the plain path (the caller's
``matmul(spec, x, w)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxtron.parallel.axes import TENSOR
from jaxtron.parallel.sharding import current_context, logical_to_spec, mesh_axes_of

log = logging.getLogger(__name__)

# The weight axis of the residual stream's hidden dim: a weight contracting it reads the residual stream, one
# producing it writes into the residual stream, whose sequence axis is named RESIDUAL_SEQ.
RESIDUAL_AXIS = "embed"
RESIDUAL_SEQ = "act_res_seq"

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxtron_tp_comm_overlap", default=False)
_LOGGED: set[str] = set()


@contextlib.contextmanager
def overlapping(enabled: bool) -> Iterator[None]:
    """Projections traced inside this block take the collective matmul where it applies (``enabled``), else the
    plain path. The Layout enters it in ``tracing()`` with ``parallel.tp_comm_overlap``."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)


def _parse(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    return xs, ws, out


def plan(spec: str, x_shape: Sequence[int], w_names: Sequence[Optional[str]]) -> Optional[tuple]:
    """``("gather" | "scatter", T, mesh, seq letter, weight letter on tensor)`` when ``einsum(spec, x, w)``
    with ``w``'s logical ``w_names`` (the last ``len(ws)`` count) runs as a collective matmul under the current
    rules and mesh and ``parallel.tp_comm_overlap``; None for the plain path."""
    ctx = current_context()
    if not _ENABLED.get() or ctx is None or ctx[1] is None:
        return None
    rules, mesh = ctx
    t = dict(mesh.shape).get(TENSOR, 1)
    seq_axes = mesh_axes_of(logical_to_spec((RESIDUAL_SEQ,), rules)[0])
    if t <= 1 or TENSOR not in seq_axes or any(dict(mesh.shape)[a] > 1 for a in seq_axes if a != TENSOR):
        return None  # no sequence parallelism over tensor, or the sequence split over context too
    if any(kind == AxisType.Manual for kind in getattr(mesh, "axis_types", ())):
        # inside a pipeline's stage shard_map: a 1f1b tick already overlaps one micro batch's tensor collectives
        # with another's GEMMs, and the planner predicts the rings slower there (Llama-3-70B tensor 4 x stage 4:
        # 30.8 -> 33.9 s per step, docs/parallelism.md), so pipelines keep the plain collectives
        _log_once("parallel.tp_comm_overlap: projections inside pipeline stages keep the plain collectives")
        return None
    xs, ws, ys = _parse(spec)
    names = tuple(w_names)[len(w_names) - len(ws):]
    tokens = [c for c in xs if c not in ws]
    if len(tokens) != 2 or any(c not in ys for c in tokens) or x_shape[xs.index(tokens[1])] % t:
        return None  # not [batch, seq, ...] activations, or a sequence that does not split into T chunks
    on_tensor = [c for c, n in zip(ws, names)
                 if n is not None and TENSOR in mesh_axes_of(logical_to_spec((n,), rules)[0])]
    if len(on_tensor) != 1 or mesh_axes_of(logical_to_spec((names[ws.index(on_tensor[0])],), rules)[0]) != (TENSOR,):
        return None
    contracted = [n for c, n in zip(ws, names) if c in xs]
    produced = [n for c, n in zip(ws, names) if c not in xs]
    split = on_tensor[0]
    if contracted == [RESIDUAL_AXIS] and split not in xs:
        kind = "gather"
    elif produced == [RESIDUAL_AXIS] and split in xs:
        kind = "scatter"
    else:
        return None
    return kind, t, mesh, tokens[1], split


def projects(x: jax.Array, ops: Sequence[tuple], matmul: Callable[[str, jax.Array, jax.Array], jax.Array],
             quantized: bool = False) -> Optional[list]:
    """The projections ``matmul(spec, x, w)`` of one input ``x`` by the weights of ``ops``, ``(spec, w,
    w_names)`` each (``w_names``: the weight's logical axis names), as collective matmuls over ``tensor``
    (module doc): several column-parallel ones (Q, K and V; gate and up) share one ring, each chunk multiplied
    by every weight while the next one moves. None where the plain path applies (the caller then runs
    ``matmul`` itself); ``quantized``: the projections are FP8, which keep the plain path (logged once)."""
    plans = [plan(spec, x.shape, names) for spec, _, names in ops]
    kinds = {p and p[0] for p in plans}
    if None in kinds or len(kinds) != 1 or (kinds == {"scatter"} and len(ops) > 1):
        return None
    if quantized:
        _log_once("parallel.tp_comm_overlap: FP8 projections keep the plain all-gather/reduce-scatter "
                  "(a per-chunk quantization would change the tensorwise scales)")
        return None
    kind, t, mesh, seq = plans[0][:4]
    specs = [_parse(spec) for spec, _, _ in ops]
    splits = [p[4] for p in plans]
    xs = specs[0][0]
    spec_of = lambda letters, on: P(*(TENSOR if c == on else None for c in letters))  # noqa: E731
    ring = [(j, (j + 1) % t) for j in range(t)]
    _log_once(f"parallel.tp_comm_overlap: collective matmuls over tensor={t} ({t} ppermute ring steps)")

    if kind == "gather":
        def body(x, *ws):
            me, c = jax.lax.axis_index(TENSOR), x.shape[xs.index(seq)]
            outs, chunk = [None] * len(ws), x
            for i in range(t):
                # the next chunk's transfer is issued before this chunk's GEMMs, which do not wait on it
                nxt = jax.lax.ppermute(chunk, TENSOR, ring) if i < t - 1 else None
                ys_i = [matmul(spec, chunk, w) for (spec, _, _), w in zip(ops, ws)]  # chunk of rank (me - i) mod T
                if nxt is not None:
                    # step i's GEMMs finish before step i + 1's transfer starts, so XLA's scheduler (which would
                    # put every chunk's GEMM under the last transfer of the chain) overlaps each with its own
                    nxt, *ys_i = jax.lax.optimization_barrier((nxt, *ys_i))
                for j, ((_, _, ys), y) in enumerate(zip(specs, ys_i)):
                    at = ys.index(seq)
                    if outs[j] is None:
                        outs[j] = jnp.zeros(y.shape[:at] + (c * t,) + y.shape[at + 1:], y.dtype)
                    outs[j] = jax.lax.dynamic_update_slice_in_dim(outs[j], y, ((me - i) % t) * c, at)
                chunk = nxt
            return tuple(outs)

        in_specs = (spec_of(xs, seq),) + tuple(spec_of(ws, on) for (_, ws, _), on in zip(specs, splits))
        out_specs = tuple(spec_of(ys, on) for (_, _, ys), on in zip(specs, splits))
    else:
        (spec, _, _), (_, ws, ys), split = ops[0], specs[0], splits[0]

        def body(x, w):
            axis, me = xs.index(seq), jax.lax.axis_index(TENSOR)
            c = x.shape[axis] // t
            acc = None
            for i in range(t):
                # the partial sum for chunk (me + T-1-i) mod T: it travels T-1-i more steps and ends on its owner
                block = jax.lax.dynamic_slice_in_dim(x, ((me + t - 1 - i) % t) * c, c, axis)
                if acc is not None:
                    # this step's GEMM starts after the sum it is added to is complete (and so cannot be moved
                    # under an earlier transfer): it runs while that sum travels
                    acc, block = jax.lax.optimization_barrier((acc, block))
                part = matmul(spec, block, w)
                acc = part if acc is None else jax.lax.ppermute(acc, TENSOR, ring) + part
            return (acc,)

        in_specs, out_specs = (spec_of(xs, split), spec_of(ws, split)), (spec_of(ys, seq),)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names=frozenset({TENSOR}), check_vma=False)
    return list(mapped(x, *(w for _, w, _ in ops)))
