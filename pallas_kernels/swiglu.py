"""Fused SwiGLU activation silu(gate) * up as a Pallas kernel, with a Pallas backward.

Public API:
  swiglu(gate, up, *, interpret=None, block_rows=16, block_cols=1024, backend="triton") -> silu(gate) * up
  swiglu_reference(gate, up) -> plain jnp

Design:
  * Any leading shape: inputs are flattened to 2D [rows, features]; the grid is (rows/block_rows,
    features/block_cols) with power-of-two blocks clamped to the (padded) problem size; ragged edges are zero-padded
    in the wrapper and sliced off afterwards (silu(0)*0 = 0, so padding is harmless).
  * fp32 math inside the kernels; outputs in the input dtype.
  * jax.custom_vjp; the backward kernel reads gate, up and the cotangent g once and writes both
        d_gate = g * up * sig * (1 + gate * (1 - sig)),   d_up = g * silu(gate),   sig = sigmoid(gate)
    (nothing but the inputs is saved as residuals, the sigmoid is recomputed).
  * `backend` dispatches through _IMPLS; only "triton" exists, a Mosaic GPU variant can be added beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._common import cdiv, check_backend, pick_block, resolve_interpret

__all__ = ["swiglu", "swiglu_reference"]


def swiglu_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _fwd_kernel(gate_ref, up_ref, o_ref):
    g = gate_ref[...].astype(jnp.float32)
    u = up_ref[...].astype(jnp.float32)
    o_ref[...] = (g * _sigmoid(g) * u).astype(o_ref.dtype)


def _bwd_kernel(gate_ref, up_ref, do_ref, dgate_ref, dup_ref):
    g = gate_ref[...].astype(jnp.float32)
    u = up_ref[...].astype(jnp.float32)
    do = do_ref[...].astype(jnp.float32)
    sig = _sigmoid(g)
    silu = g * sig
    dgate_ref[...] = (do * u * sig * (1.0 + g * (1.0 - sig))).astype(dgate_ref.dtype)
    dup_ref[...] = (do * silu).astype(dup_ref.dtype)


def _pad2(x, rp, cp):
    r, c = x.shape
    return x if (rp, cp) == (r, c) else jnp.pad(x, ((0, rp - r), (0, cp - c)))


def _swiglu_triton(*arrays, bwd: bool, interpret: bool, block_rows: int, block_cols: int,
                   num_warps: int = 4, num_stages: int = 1):
    """arrays: (gate, up) for the forward, (gate, up, g) for the backward; all 2D [rows, features]."""
    rows, cols = arrays[0].shape
    br = pick_block(block_rows, rows, "block_rows")
    bc = pick_block(block_cols, cols, "block_cols")
    rp, cp = cdiv(rows, br) * br, cdiv(cols, bc) * bc
    padded = [_pad2(a, rp, cp) for a in arrays]
    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    if bwd:
        out_shape = (jax.ShapeDtypeStruct((rp, cp), arrays[0].dtype), jax.ShapeDtypeStruct((rp, cp), arrays[1].dtype))
        out_specs = (spec, spec)
        kernel, name = _bwd_kernel, "swiglu_bwd"
    else:
        out_shape = jax.ShapeDtypeStruct((rp, cp), arrays[0].dtype)
        out_specs = spec
        kernel, name = _fwd_kernel, "swiglu_fwd"
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(rp // br, cp // bc),
        in_specs=[spec] * len(arrays),
        out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*padded)
    if (rp, cp) != (rows, cols):
        out = jax.tree.map(lambda o: o[:rows, :cols], out)
    return out


_IMPLS = {"triton": _swiglu_triton}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _swiglu2d(gate, up, backend, interpret, block_rows, block_cols):
    return _IMPLS[backend](gate, up, bwd=False, interpret=interpret, block_rows=block_rows, block_cols=block_cols)


def _swiglu2d_fwd(gate, up, backend, interpret, block_rows, block_cols):
    out = _IMPLS[backend](gate, up, bwd=False, interpret=interpret, block_rows=block_rows, block_cols=block_cols)
    return out, (gate, up)


def _swiglu2d_bwd(backend, interpret, block_rows, block_cols, res, g):
    gate, up = res
    d_gate, d_up = _IMPLS[backend](gate, up, g, bwd=True, interpret=interpret, block_rows=block_rows,
                                   block_cols=block_cols)
    return d_gate, d_up


_swiglu2d.defvjp(_swiglu2d_fwd, _swiglu2d_bwd)


def swiglu(gate: jax.Array, up: jax.Array, *, interpret: bool | None = None, block_rows: int = 16,
           block_cols: int = 1024, backend: str = "triton") -> jax.Array:
    """silu(gate) * up, fused; any leading shape, gate.shape == up.shape; output in gate's dtype."""
    check_backend(backend, _IMPLS, "swiglu")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {gate.shape} and {up.shape}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must share a dtype, got {gate.dtype} and {up.dtype}")
    if gate.ndim == 0 or gate.size == 0:
        raise ValueError(f"swiglu needs a non-empty array with at least one dimension, got shape {gate.shape}")
    pick_block(block_rows, 1, "block_rows")
    pick_block(block_cols, 1, "block_cols")
    shape = gate.shape
    cols = shape[-1]
    rows = gate.size // cols
    out = _swiglu2d(gate.reshape(rows, cols), up.reshape(rows, cols), backend, resolve_interpret(interpret),
                    block_rows, block_cols)
    return out.reshape(shape)
