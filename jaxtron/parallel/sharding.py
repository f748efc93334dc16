"""Logical names -> shardings, and the activation constraint the model calls at block boundaries."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Optional, Sequence

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_STATE = threading.local()


@contextlib.contextmanager
def use_rules(rules: Sequence[tuple[str, Any]], mesh: Optional[Mesh] = None) -> Iterator[None]:
    """Make ``rules`` (and ``mesh``) what :func:`constrain` uses while tracing the model.

    Without ``mesh``, the mesh set by ``jax.set_mesh`` is used."""
    prev = getattr(_STATE, "ctx", None)
    prev_platform = getattr(_STATE, "platform", None)
    _STATE.ctx = (tuple(rules), mesh)
    if mesh is not None and hasattr(mesh, "devices"):
        # kept for nested contexts without a concrete mesh (inside a pipeline's shard_map), so that a step
        # compiled ahead of time for GPUs from a CPU host runs its kernels, not their interpreters, in stages too
        _STATE.platform = mesh.devices.flat[0].platform
    try:
        with nnx.logical_axis_rules(tuple(rules)):
            yield
    finally:
        _STATE.ctx = prev
        _STATE.platform = prev_platform


def current_context() -> Optional[tuple[tuple, Optional[Mesh]]]:
    """(rules, mesh) of the enclosing :func:`use_rules`, or None; the mesh is the one set by ``jax.set_mesh``
    when use_rules got none (None if there is none)."""
    ctx = getattr(_STATE, "ctx", None)
    if ctx is None:
        return None
    rules, mesh = ctx
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        mesh = None if abstract is None or abstract.empty else abstract
    return rules, mesh


def logical_to_spec(names: Sequence[Optional[str]], rules: Sequence[tuple[str, Any]]) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(names), tuple(rules))


def logical_to_sharding(names: Sequence[Optional[str]], mesh: Mesh, rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """Constrain an activation's sharding by logical axis names; a no-op outside a mesh + rules context."""
    ctx = getattr(_STATE, "ctx", None)
    if ctx is None:
        return x
    rules, mesh = ctx
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    spec = logical_to_spec(names, rules)
    if mesh is not None:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is None or abstract.empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def mesh_axes_of(entry, mesh: Optional[Mesh] = None) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry (or one ``logical_to_spec`` result) splits its dimension over,
    as a tuple: ``()`` for ``None``, ``(a,)`` for one name ``a``, the names in order for a tuple. With ``mesh``,
    only those of more than one device there (an axis the mesh lacks counts as one).

    A spec entry has three spellings for one thing; code that asks "is ``tensor`` among them", multiplies their
    sizes or appends an axis needs the tuple, and the parallel modules (collective matmul, expert dispatch,
    ZeRO, ring attention, the embedding lookup) all ask it, so it is spelled once here."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return axes if mesh is None else tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def matmul_weight(w: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """A weight as its matmul reads it: ``w`` (logical ``names``; the last ``w.ndim`` of them count, so a
    scanned layer's slice may pass its stacked names) gathered over the mesh axes that split the tokens
    (``act_batch``'s and ``act_seq``'s: ZeRO-3's ``fsdp`` and ``context``) along every axis whose activation
    (``act_<name>``) the rules split too; otherwise ``w`` unchanged, as under the default rules.

    ZeRO-3 gathers the weight before its matmul anyway; this says so because XLA's SPMD partitioner (jax
    0.10.2 to at least 0.12.0.1, CPU and GPU) miscompiles the other way: a matmul whose rows are split over
    two axes, say ``("data", "fsdp")``, whose weight's output axis is split over the minor one (``fsdp``) and
    whose result puts that output axis on the contracted axis (``tensor``) returns the row blocks of two
    devices swapped (docs/parallelism.md, "Moving a rule never changes the numbers"). With ``act_embed`` on
    ``tensor`` every projection into the residual stream is such a matmul (layer 0's attention output came
    out 96% wrong), and in the backward so is every input gradient flowing into it."""
    ctx = current_context()
    if ctx is None or ctx[1] is None:
        return w
    rules, mesh = ctx
    names = tuple(names)[len(names) - w.ndim:]
    tokens = {a for name in ("act_batch", "act_seq") for a in mesh_axes_of(logical_to_spec((name,), rules)[0])}
    spec = list(logical_to_spec(names, rules))
    changed = False
    for i, name in enumerate(names):
        axes = mesh_axes_of(spec[i])
        if name is None or not tokens & set(axes) or logical_to_spec((f"act_{name}",), rules)[0] is None:
            continue
        kept = tuple(a for a in axes if a not in tokens)
        spec[i], changed = (kept[0] if len(kept) == 1 else kept or None), True
    if not changed:
        return w
    if hasattr(mesh, "devices"):
        return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec(*spec)))
    return jax.lax.with_sharding_constraint(w, PartitionSpec(*spec))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(abstract_state: nnx.State) -> dict:
    """Pure dict (the layout of ``state.to_pure_dict()``) of each Variable's logical axis names."""
    def names(v):
        n = v.get_metadata().get("out_sharding")
        return PartitionSpec(*n) if n is not None else PartitionSpec()

    return jax.tree.map(names, abstract_state, is_leaf=_is_variable).to_pure_dict()


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules) -> dict:
    """Pure dict of NamedShardings for an nnx State whose Variables carry ``out_sharding`` logical names."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, logical_to_spec(tuple(spec), rules)),
                        logical_names(abstract_state), is_leaf=lambda x: isinstance(x, PartitionSpec))


def devices_are_cpu() -> bool:
    """Whether the devices of the current mesh (else JAX's default backend) are CPUs. Decided by the mesh, not
    the default backend, so a step compiled for GPUs from a CPU-only machine (ahead of time) gets GPU code."""
    ctx = getattr(_STATE, "ctx", None)
    mesh = ctx[1] if ctx else None
    if mesh is not None and hasattr(mesh, "devices"):
        return mesh.devices.flat[0].platform == "cpu"
    platform = getattr(_STATE, "platform", None)
    return platform == "cpu" if platform else jax.default_backend() == "cpu"


def per_shard(fn, in_names: Sequence, out_names):
    """``fn`` run on each device's shard (``jax.shard_map``): every argument and result is split as its
    logical names map under the current rules; mesh axes a name does not map to are replicated. ``out_names``
    is a tuple of names for one result, a list of such tuples for a tuple of results. This is how
    per-device kernels (Pallas) compose with data, FSDP and tensor parallelism. ``None`` in ``in_names``
    marks an argument passed as is (e.g. an absent optional input). Outside a mesh + rules context, ``fn``
    itself is returned."""
    ctx = current_context()
    if ctx is None or ctx[1] is None:
        return fn
    rules, mesh = ctx
    spec = lambda names: logical_to_spec(names, rules)
    # one result: a tuple of names; several: a list of them
    out_specs = tuple(spec(n) for n in out_names) if isinstance(out_names, list) else spec(out_names)

    def call(*args):
        keep = [i for i, names in enumerate(in_names) if names is not None]

        def body(*sharded):
            full = list(args)
            for i, a in zip(keep, sharded):
                full[i] = a
            return fn(*full)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(spec(in_names[i]) for i in keep),
                               out_specs=out_specs, check_vma=False)
        return mapped(*(args[i] for i in keep))

    return call


def per_shard_2d(fn, dims: dict, in_dims: Sequence[str], out_dims: Sequence[str]):
    """``fn(sum_over, *args)`` run on each device's blocks of 2-D operands whose axes are letters: ``dims`` maps
    a letter to the logical names of the array axes merged into it (``{"m": ("act_batch", "act_seq")}``), and
    the letter is split over their mesh axes in order; ``in_dims``/``out_dims`` give each operand's and result's
    two letters (``"mk"``). ``sum_over(x, letter)`` inside ``fn`` sums a partial result over the mesh axes of a
    contracted letter (a matmul contracting a split axis). Outside a mesh + rules context ``fn`` runs on the
    whole arrays with ``sum_over`` the identity."""
    ctx = current_context()
    if ctx is None or ctx[1] is None:
        return functools.partial(fn, lambda x, letter: x)
    rules, mesh = ctx
    axes = {}
    for letter, names in dims.items():
        spec = logical_to_spec(tuple(names), rules)
        axes[letter] = tuple(a for entry in spec for a in mesh_axes_of(entry, mesh))
    spec = lambda d: PartitionSpec(*(axes[c] or None for c in d))  # noqa: E731

    def sum_over(x, letter):
        return jax.lax.psum(x, axes[letter]) if axes[letter] else x

    return jax.shard_map(functools.partial(fn, sum_over), mesh=mesh, in_specs=tuple(spec(d) for d in in_dims),
                         out_specs=tuple(spec(d) for d in out_dims), check_vma=False)
