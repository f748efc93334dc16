"""The model's matmuls: ``Matmuls.project(spec, x, w)`` (activations with a weight: every linear layer and the LM
head) and ``Matmuls.contract(spec, a, b)`` (activations with activations: attention scores and values).

Which implementation runs is a :class:`Matmuls` value the model is built with (a static attribute of its
modules, not a parameter), decided once where the program is built from the devices its layout runs on
(``Matmuls.on(layout.platform)``), so a program compiled for GPUs on a CPU-only machine gets GPU code and a
test can build either and look at what it lowers to.

On GPUs and TPUs (``Matmuls(cpu=False)``) both are ``jnp.einsum``, except a projection of 16-bit operands with
an fp32 result (the LM head's logits): its backward rounds the fp32 cotangent to the operands' dtype first, as on
CPUs (below). Left to JAX, the transpose multiplies the fp32 cotangent by the bf16 weight, which XLA:GPU runs as
fp32 x fp32 GEMMs: the LM head's backward, twice its forward's FLOPs, at the fp32/TF32 rate. On CPUs
(``Matmuls(cpu=True)``) both are ``custom_vjp``s shaped for XLA:CPU:

- Every matmul accumulates in fp32 and rounds its result afterwards. JAX 0.10's XLA:CPU runs a bf16 x bf16
  matmul on its native kernel (AVX512-BF16) only when the result is fp32; asked for a bf16 result it converts
  both operands to fp32 first and takes the fp32 kernel, about twice as slow (``scripts/bench_cpu_matmul.py``;
  JAX 0.12 runs both natively, at the same speed).
- In the backward of bf16 inputs, an fp32 cotangent (the LM head's, whose logits are fp32 for the loss, and
  attention's, whose softmax is fp32) is rounded to bf16 before its two matmuls, as Megatron and MaxText do
  (their bf16 logits and scores get bf16 cotangents) and as flash attention does with dS. A mixed fp32 x bf16
  matmul would again take the fp32 kernel.
- ``project``'s weight gradient is computed from a copy of the activations transposed so that the token axes
  are minor (``x^T`` materialized, then an ordinary matmul). Left to itself, XLA:CPU's layout assignment
  transposes the *other* operand of that matmul, the incoming gradient, and fuses the transpose into whatever
  produced it: for the SwiGLU gate that is the SiLU backward, which then runs element by element in
  transposed order, unvectorized (measured: 67 of 353 ms of a 4-layer train step on one CPU device, against
  about 2 ms for the copy of ``x``).

In fp32 the numbers are those of ``jnp.einsum`` (same contractions, fp32 accumulation either way).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


def parse_spec(spec: str) -> tuple[str, str, str]:
    """``"bsd,df->bsf"`` -> ("bsd", "df", "bsf"): the two operands' axes and the result's."""
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


def _einsum_f32(spec: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    out_dtype = out_dtype or jnp.result_type(a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _cotangent(dy: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The incoming gradient in the inputs' dtype when both inputs share a low-precision one."""
    if a.dtype == b.dtype and jnp.dtype(a.dtype).itemsize < 4:
        return dy.astype(a.dtype)
    return dy


def _rounding_matmul(grads):
    """A ``custom_vjp`` matmul ``(spec, a, b, out_dtype)`` computed by ``_einsum_f32``, whose backward is
    ``grads(spec, a, b, dy) -> (da, db)`` with ``dy`` already in the inputs' dtype (``_cotangent``)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
    def matmul(spec, a, b, out_dtype):
        return _einsum_f32(spec, a, b, out_dtype)

    def fwd(spec, a, b, out_dtype):
        return _einsum_f32(spec, a, b, out_dtype), (a, b)

    def bwd(spec, out_dtype, res, dy):
        a, b = res
        return grads(spec, a, b, _cotangent(dy, a, b))

    matmul.defvjp(fwd, bwd)
    return matmul


def _project_grads(spec, x, w, dy):
    xs, ws, ys = parse_spec(spec)
    dx = _einsum_f32(f"{ys},{ws}->{xs}", dy, w, x.dtype)
    # Axes of x that the weight lacks (batch, sequence) go last: the contraction runs over x's minor axes.
    xt_spec = "".join(a for a in xs if a in ws) + "".join(a for a in xs if a not in ws)
    # The barrier keeps XLA from folding the transpose back into the dot (which is what it would otherwise
    # lay out the other way round).
    xt = jax.lax.optimization_barrier(jnp.einsum(f"{xs}->{xt_spec}", x))
    dw = _einsum_f32(f"{xt_spec},{ys}->{ws}", xt, dy, w.dtype)
    return dx, dw


def _contract_grads(spec, a, b, dy):
    as_, bs, ys = parse_spec(spec)
    return _einsum_f32(f"{ys},{bs}->{as_}", dy, b, a.dtype), _einsum_f32(f"{as_},{ys}->{bs}", a, dy, b.dtype)


def _low_precision_grads(spec, a, b, dy):
    """The two GEMMs of a contraction's backward with results in their operands' dtype: a GPU GEMM of 16-bit
    operands accumulates in fp32 and rounds once, the numbers of ``_contract_grads``. Here the weight
    gradient's result is 16-bit, so under FSDP XLA reduce-scatters it in bf16, as every other weight gradient
    of the step, where ``_contract_grads``' fp32 result (its rounding folded away by XLA, which allows excess
    precision) made the LM head's the one fp32 reduce-scatter: 2 GB a micro batch on Llama-3-8B."""
    as_, bs, ys = parse_spec(spec)
    return jnp.einsum(f"{ys},{bs}->{as_}", dy, b), jnp.einsum(f"{as_},{ys}->{bs}", a, dy)


_cpu_project = _rounding_matmul(_project_grads)
_cpu_contract = _rounding_matmul(_contract_grads)
# the GPU's LM head: fp32 logits, its backward's cotangent rounded first
_rounded_project = _rounding_matmul(_low_precision_grads)


@dataclasses.dataclass(frozen=True)
class Matmuls:
    """The model's matmul implementation: ``cpu`` the ``custom_vjp``s shaped for XLA:CPU, else ``jnp.einsum``
    (with the rounded LM-head backward). Frozen and hashable: modules keep it as a static attribute."""

    cpu: bool = False

    @classmethod
    def on(cls, platform: str) -> "Matmuls":
        """The implementation for devices of ``platform`` ('cpu', 'gpu', 'tpu', ...)."""
        return cls(cpu=platform == "cpu")

    @classmethod
    def here(cls) -> "Matmuls":
        """For a model built outside a program (tests, scripts): JAX's default backend's."""
        return cls.on(jax.default_backend())

    def project(self, spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
        """``jnp.einsum(spec, x, w, preferred_element_type=out_dtype)`` where ``w`` is a weight (no batch axes),
        e.g. ``"bsd,df->bsf"``."""
        if self.cpu:
            return _cpu_project(spec, x, w, out_dtype)
        if out_dtype is not None and jnp.dtype(out_dtype).itemsize > jnp.dtype(x.dtype).itemsize == 2 \
                and x.dtype == w.dtype:
            return _rounded_project(spec, x, w, out_dtype)
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)

    def contract(self, spec: str, a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
        """``jnp.einsum(spec, a, b, preferred_element_type=out_dtype)`` for two activations (every axis of the
        output and of the contraction belongs to at least one of them), e.g. attention's ``"bqhd,bkhd->bhqk"``."""
        if self.cpu:
            return _cpu_contract(spec, a, b, out_dtype)
        return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
