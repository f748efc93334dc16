"""Parameters cast to the compute dtype once per step (``train.cast_params_once``), not once per use.

The model keeps fp32 master weights and casts each weight where it is used (``weight[...].astype(x.dtype)``
in every projection, the embedding lookup, the LM head): in every micro batch of gradient accumulation, and
under remat again in the backward. The train step instead casts those weights once, before the micro-batch
loop, and differentiates with respect to the cast copy; the model's own casts are then no-ops (``astype`` to
the dtype an array has already traces to nothing). Under FSDP the copy is sharded as the params, each rank
casting its shard (XLA:GPU already moved the per-use casts ahead of the all-gathers: they move bf16 either
way, docs/performance.md). Pipelines (``parallel.stage > 1``) take the same rule as a tree of dtypes
(:meth:`ParamCast.dtype_tree`) and cast once per step, not per tick, each schedule where its sum over micro
batches keeps these numbers (jaxtron/parallel/pipeline.py, beside ``CAST_BEFORE_LOOP``).

Which leaves are cast is read from the loss's own trace, so the rule is the model's, not a second list: a
leaf is cast iff its only use is a conversion to a narrower float dtype (looking through the layer scan's
per-layer slices, ``jax.checkpoint``, nested jits and layout-only ops: sharding constraints, transposes).
That keeps the numerics of the per-use cast exactly:

- the forward multiplies the same bf16 values;
- the gradient of the copy is the cotangent of the model's cast, which the per-use path converts to fp32
  unchanged; the step converts it to fp32 and accumulates over micro batches in fp32, as before;
- a leaf used more than once (tied embeddings: the lookup and the LM head), or closed over by a loop (its
  per-iteration gradients are summed), would have its gradients summed in bf16 instead of fp32: not cast;
- a leaf the model computes with in fp32 (norm scales, the MoE router, FP8 amax histories), or hands to a
  ``custom_vjp`` or ``shard_map`` (the chunked LM head, which sums its chunks' gradients in fp32; the MoE
  experts, cast inside the expert-parallel shard_map so their gradients are reduced in fp32): not cast.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxtron.jaxprs import scan_groups

# ops that move or relabel elements without arithmetic: a cast commutes with them exactly
_LAYOUT_ONLY = ("sharding_constraint", "transpose")
# ops that run a nested jaxpr on their operands one to one (a use inside is the use)
_NESTED = ("jit", "pjit", "closed_call", "remat2", "checkpoint")


def _inner(eqn, index: int):
    """(nested jaxpr, its variable) that operand ``index`` of ``eqn`` becomes, or None where the operand is not
    passed through one to one (a loop's constants and carries are used every iteration: not one use)."""
    name = eqn.primitive.name
    if name == "scan":
        split = scan_groups(eqn)
        if split is None or index < split[0] + split[1]:
            return None
        body = eqn.params["jaxpr"].jaxpr
        return body, body.invars[index]
    if name not in _NESTED:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's open jaxpr
    if inner is None or len(inner.invars) != len(eqn.invars):
        return None
    return inner, inner.invars[index]


def _sole_cast(jaxpr, var) -> Optional[Any]:
    """The dtype ``var`` is cast to if its one use (through layout-only ops and nested jaxprs) is a conversion
    to a narrower float; else None."""
    uses = [(eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.invars) if v is var]
    if len(uses) != 1 or any(v is var for v in jaxpr.outvars):
        return None
    eqn, index = uses[0]
    name = eqn.primitive.name
    if name == "convert_element_type":
        old, new = jnp.dtype(var.aval.dtype), jnp.dtype(eqn.params["new_dtype"])
        narrower = jnp.issubdtype(old, jnp.floating) and jnp.issubdtype(new, jnp.floating)
        return new if narrower and new.itemsize < old.itemsize else None
    if name in _LAYOUT_ONLY:
        return _sole_cast(jaxpr, eqn.outvars[0])
    inner = _inner(eqn, index)
    return None if inner is None else _sole_cast(*inner)


class ParamCast:
    """Which parameter leaves the loss casts once per use, and to what: found from one trace of
    ``loss(params, *args)`` (abstract; run it inside the step's trace, under the layout's mesh and rules).
    ``dtypes``: a flat list over ``jax.tree.leaves(params)``, a dtype or None (kept)."""

    def __init__(self, loss: Callable, params, *args):
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        closed = jax.make_jaxpr(loss)(jax.tree.map(abstract, params), *jax.tree.map(abstract, args))
        leaves, self.treedef = jax.tree.flatten(params)
        self.dtypes = [_sole_cast(closed.jaxpr, v) for v in closed.jaxpr.invars[:len(leaves)]]

    @property
    def any(self) -> bool:
        return any(d is not None for d in self.dtypes)

    def dtype_tree(self, params):
        """A tree like ``params`` of the dtype each leaf is cast to (its own dtype where it is kept)."""
        leaves = jax.tree.leaves(params)
        return self.treedef.unflatten([jnp.dtype(p.dtype) if d is None else d for p, d in zip(leaves, self.dtypes)])

    def cast(self, params):
        """``params`` with the leaves the loss casts already in the dtype it casts them to."""
        leaves = jax.tree.leaves(params)
        return self.treedef.unflatten([p if d is None else p.astype(d) for p, d in zip(leaves, self.dtypes)])
