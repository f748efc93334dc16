"""``project(spec, x, w)``: the einsum of activations with a weight (every linear layer of the model).

On GPUs and TPUs it is ``jnp.einsum``. On CPUs its backward computes the weight gradient from a copy of the
activations transposed so that the token axes are minor (``x^T`` materialized, then an ordinary matmul).
Left to itself, XLA:CPU's layout assignment transposes the *other* operand of that matmul, the incoming
gradient, and fuses the transpose into whatever produced it: for the SwiGLU gate that is the SiLU backward,
which then runs element by element in transposed order, unvectorized (measured: 67 of 353 ms of a 4-layer
train step on one CPU device, against about 2 ms for the copy of ``x``). The forward and ``dx`` are unchanged,
and so are the numbers (same contractions, fp32 accumulation either way).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtron.parallel.sharding import devices_are_cpu


def _parse(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    return x, w, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _cpu_project(spec: str, x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _fwd(spec, x, w, out_dtype):
    return _cpu_project(spec, x, w, out_dtype), (x, w)


def _bwd(spec, out_dtype, res, dy):
    x, w = res
    xs, ws, ys = _parse(spec)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", dy, w).astype(x.dtype)
    # Axes of x that the weight lacks (batch, sequence) go last: the contraction runs over x's minor axes.
    xt_spec = "".join(a for a in xs if a in ws) + "".join(a for a in xs if a not in ws)
    # The barrier keeps XLA from folding the transpose back into the dot (which is what it would otherwise
    # lay out the other way round).
    xt = jax.lax.optimization_barrier(jnp.einsum(f"{xs}->{xt_spec}", x))
    dw = jnp.einsum(f"{xt_spec},{ys}->{ws}", xt, dy).astype(w.dtype)
    return dx, dw


_cpu_project.defvjp(_fwd, _bwd)


def project(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``jnp.einsum(spec, x, w, preferred_element_type=out_dtype)`` where ``w`` is a weight (no batch axes),
    e.g. ``"bsd,df->bsf"``."""
    if devices_are_cpu():
        return _cpu_project(spec, x, w, out_dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
