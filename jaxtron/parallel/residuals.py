"""A stage's VJP residuals, kept per micro batch: the pipeline schedules run the forward of a micro batch in one
tick and its backward in a later one, and keep what the backward needs in between instead of running the
forward again.

``jax.vjp(fn, params, x)`` returns its pullback as a ``jax.tree_util.Partial`` whose leaves are the residuals.
Some of them depend on the micro batch (activations, attention statistics, token ids): those are kept, one
copy per micro batch in flight. Others depend on the weights alone (the weights themselves, their bf16 casts,
an all-gathered FSDP shard): keeping them per micro batch would hold one more copy of the stage's weights per
slot, so the backward makes them again from the weights (a cast or a gather, no matmul: the rest of that
forward has no use and XLA removes it). Which is which is read from the jaxpr of the forward
(:func:`micro_batch_dependent`), by following the micro batch's inputs through it.

``model.remat`` is respected as it is: with a ``jax.checkpoint`` policy inside the stage, the residuals are what
that policy saves (block inputs only under ``full``; everything under ``none``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxtron.jaxprs import scan_groups
from jaxtron.parallel.backward_split import SplitBackward


def _jaxpr_of(value) -> Jaxpr | None:
    if isinstance(value, ClosedJaxpr):
        return value.jaxpr
    return value if isinstance(value, Jaxpr) else None


def _flow(jaxpr: Jaxpr, tainted_in: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on its inputs marked True (constants are not marked)."""
    marked = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, Literal) and v in marked for v in eqn.invars]
        for v, t in zip(eqn.outvars, _eqn_flow(eqn, ins)):
            if t:
                marked.add(v)
    return [not isinstance(v, Literal) and v in marked for v in jaxpr.outvars]


def _eqn_flow(eqn, ins: list[bool]) -> list[bool]:
    n_out = len(eqn.outvars)
    if not any(ins):
        return [False] * n_out
    name, params = eqn.primitive.name, eqn.params
    groups = scan_groups(eqn) if name == "scan" else None
    if groups is not None:  # carries: iterate to a fixed point (a carry marked in one iteration stays marked)
        body = params["jaxpr"].jaxpr
        nc, ncarry = groups
        carry = list(ins[nc:nc + ncarry])
        while True:
            out = _flow(body, ins[:nc] + carry + ins[nc + ncarry:])
            new = [a or b for a, b in zip(carry, out[:ncarry])]
            if new == carry:
                return carry + out[ncarry:]
            carry = new
    if name == "cond":  # operand 0 picks the branch; an output depends on what any branch reads
        if ins[0]:
            return [True] * n_out
        outs = [_flow(_jaxpr_of(b), ins[1:]) for b in params["branches"]]
        return [any(col) for col in zip(*outs)]
    for value in params.values():  # jit, remat, custom_jvp/vjp calls: one body with the equation's signature
        sub = _jaxpr_of(value)
        if sub is not None and len(sub.invars) == len(ins) and len(sub.outvars) == n_out:
            return _flow(sub, ins)
    return [True] * n_out  # anything else (a while loop, an unknown call): assume it depends


def micro_batch_dependent(fn: Callable, params: Any, x: Any, m: Any, select: Any = ()) -> tuple[bool, ...]:
    """For each residual leaf of ``jax.vjp(lambda p, x: fn(p, x, m, select), params, x, has_aux=True)``: whether
    it depends on ``x`` or ``m`` (the micro batch's activation and index), i.e. must be kept per micro batch.
    ``select`` (which chunk of ``params`` the tick runs) is not the micro batch's: residuals of the weights it
    picks are made again in the backward, not kept per micro batch."""
    def leaves(params, x, m, select):
        return jax.tree.leaves(jax.vjp(lambda p, x: fn(p, x, m, select), params, x, has_aux=True)[1])

    closed = jax.make_jaxpr(leaves)(params, x, m, select)
    n_p, n_x, n_m, n_s = (len(jax.tree.leaves(a)) for a in (params, x, m, select))
    return tuple(_flow(closed.jaxpr, [False] * n_p + [True] * (n_x + n_m) + [False] * n_s))


class KeptVJP:
    """``fn(params, x, m, select) -> (out, aux)``'s forward, keeping the residuals that depend on the micro batch,
    and its backward from those (``select``: see :func:`micro_batch_dependent`).

    ``forward(params, x, m, select) -> (out, aux, kept)``; ``backward(params, kept, m, ct, select) -> (d_params,
    d_x)``; ``kept_shapes``: the ``jax.ShapeDtypeStruct`` of each kept leaf (for the slots that hold them)."""

    def __init__(self, fn: Callable, params: Any, x: Any, m: Any, select: Any = ()):
        self.fn = fn
        self.keep = micro_batch_dependent(fn, params, x, m, select)
        self.x_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        shapes = jax.eval_shape(lambda: self.forward(params, x, m, select)[2])
        self.kept_shapes = tuple(shapes)

    def _vjp(self, params, x, m, select):
        return jax.vjp(lambda p, x: self.fn(p, x, m, select), params, x, has_aux=True)

    def forward(self, params, x, m, select=()):
        out, pullback, aux = self._vjp(params, x, m, select)
        kept = [leaf for leaf, k in zip(jax.tree.leaves(pullback), self.keep) if k]
        return out, aux, tuple(kept)

    def backward(self, params, kept, m, ct, select=()):
        """The pullback rebuilt from ``kept`` and, for the weight-only residuals, a forward traced again here: its
        micro-batch part (x is zeros) feeds nothing, so XLA removes it and only the weight-only residuals
        (casts, gathers) are computed."""
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.x_shape)
        _, fresh, _ = self._vjp(params, zeros, m, select)
        leaves, tree = jax.tree.flatten(fresh)
        it = iter(kept)
        pullback = jax.tree.unflatten(tree, [next(it) if k else leaf for leaf, k in zip(leaves, self.keep)])
        return pullback(ct)

    def split(self, params, m, select=()) -> SplitBackward:
        """:meth:`backward` split into B and W (:mod:`jaxtron.parallel.backward_split`), for the zero-bubble
        schedules: ``input_part(params, kept, m, ct, select) -> (d_x, early d_params, stash)`` and
        ``weight_part(params, kept, m, ct, select, stash) -> d_params`` (``params``, ``m``, ``select``: examples
        of their shapes). ``select`` is not the micro batch's: what depends on the weights it picks alone, W
        makes again rather than taking it from the stash."""
        kept = tuple(jnp.zeros(s.shape, s.dtype) for s in self.kept_shapes)
        out = jax.eval_shape(lambda: self.fn(params, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                                  self.x_shape), m, select)[0])
        ct = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)

        def backward(params, kept, m, ct, select):
            d_params, d_x = self.backward(params, kept, m, ct, select)
            return d_x, d_params

        return SplitBackward(backward, (params, kept, m, ct, select), (False, True, True, True, False))

    def kept_bytes(self) -> int:
        """Bytes of one micro batch's kept residuals (per device of this shard_map body)."""
        return sum(s.size * jnp.dtype(s.dtype).itemsize for s in self.kept_shapes)
