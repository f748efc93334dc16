"""The model's building blocks against plain references: ``Matmuls.project`` and ``Matmuls.contract`` (the CPU
matmul paths) against ``jnp.einsum`` in value and gradient, the matmuls a model is built with deciding what its
program lowers to whatever the mesh, and ``rotate`` (RoPE) against the split/concatenate formulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_config
from jaxtron.model import fp8
from jaxtron.model.layers import apply_rope, rope_tables, rotate
from jaxtron.model.llama import Llama
from jaxtron.model.projection import Matmuls
from jaxtron.parallel.layout import Layout
from pallas_kernels.rope import rope_inv_freq, rope_reference

CPU, GPU = Matmuls(cpu=True), Matmuls(cpu=False)

SPECS = {  # spec: (x shape, w shape), as the model uses them
    "bsd,df->bsf": ((2, 24, 16), (16, 40)),
    "bsf,fd->bsd": ((2, 24, 40), (40, 16)),
    "bsd,dhk->bshk": ((2, 24, 16), (16, 4, 8)),
    "bshk,hkd->bsd": ((2, 24, 4, 8), (4, 8, 16)),
}


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float32, None), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, None)])
def test_cpu_projection_matches_einsum(spec, dtype, out_dtype):
    _check_against_einsum(spec, SPECS[spec], dtype, out_dtype, CPU.project)


@pytest.mark.parametrize("spec", ["bsd,df->bsf", "bshk,hkd->bsd"])
def test_gpu_projection_with_fp32_logits_matches_einsum(spec):
    """The GPU path of a bf16 projection with an fp32 result (the LM head): its backward rounds the cotangent to
    bf16 (XLA:GPU would otherwise run fp32 x fp32 GEMMs; tests/test_fp8.py checks the compiled 8B step)."""
    _check_against_einsum(spec, SPECS[spec], jnp.bfloat16, jnp.float32, GPU.project)


def test_gpu_lm_head_backward_gemms_return_bf16():
    """The GPU path's backward GEMMs of a bf16 projection with fp32 logits return bf16 (accumulated in fp32 by
    the GEMM): an fp32 weight gradient would be the step's one fp32 FSDP reduce-scatter (2 GB per micro batch on
    Llama-3-8B's LM head). Only the forward's logits are fp32."""
    x = jnp.ones((2, 4, 8), jnp.bfloat16)
    w = jnp.ones((8, 16), jnp.bfloat16)
    loss = lambda x, w: jnp.sum(GPU.project("bsd,dv->bsv", x, w, jnp.float32))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn.outvars[0].aval.dtype
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    yield from dots(getattr(inner, "jaxpr", inner))

    assert sorted(map(str, dots(jaxpr.jaxpr))) == ["bfloat16", "bfloat16", "float32"]


CONTRACT_SPECS = {  # attention's two contractions (GQA: 2 kv heads, 2 queries per kv head)
    "bqkgd,bskd->bkgqs": ((2, 24, 2, 2, 8), (2, 24, 2, 8)),
    "bkgqs,bskd->bqkgd": ((2, 2, 2, 24, 24), (2, 24, 2, 8)),
}


@pytest.mark.parametrize("spec", sorted(CONTRACT_SPECS))
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float32, None), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, None)])
def test_cpu_contraction_matches_einsum(spec, dtype, out_dtype):
    _check_against_einsum(spec, CONTRACT_SPECS[spec], dtype, out_dtype, CPU.contract)


def _check_against_einsum(spec, shapes, dtype, out_dtype, fn):
    """Value and both gradients of the CPU path against ``jnp.einsum``: equal to 1e-5 in fp32; in bf16 the CPU
    path rounds an fp32 cotangent to bf16 before its matmuls, so to bf16 precision."""
    xs, ws = shapes
    kx, kw, kc = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, xs, jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(kw, ws, jnp.float32)).astype(dtype)
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
    ct = jax.random.normal(kc, out_shape, jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * ct)

    ref = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    ours = lambda x, w: fn(spec, x, w, out_dtype)  # the path of the Matmuls given, whatever the backend

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        else:  # bf16 rounding (2**-8 relative) of the operands, the cotangent and the result
            np.testing.assert_allclose(a, b, rtol=0, atol=1.5e-2 * np.abs(b).max())

    close(jax.jit(ours)(x, w), jax.jit(ref)(x, w))
    g_ours = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, w)
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(x, w)
    for a, b in zip(g_ours, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        close(a, b)
    assert fn(spec, x, w, out_dtype).dtype == ref(x, w).dtype


def test_rotate_matches_split_concatenate_reference():
    kx, kp = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (2, 37, 3, 64), jnp.float32)
    positions = jax.random.randint(kp, (2, 37), 0, 4096)
    inv_freq = rope_inv_freq(64, 500000.0)
    want = rope_reference(x, positions, inv_freq)
    np.testing.assert_allclose(np.asarray(apply_rope(x, positions, inv_freq)), np.asarray(want), rtol=1e-6, atol=1e-6)
    cos, sin = rope_tables(positions, inv_freq)
    assert cos.shape == (2, 37, 32)
    # the backward: the rotation is orthogonal, so its VJP is the rotation by -angle
    ct = jax.random.normal(kp, x.shape, jnp.float32)
    (g,) = jax.vjp(lambda x: rotate(x, cos, sin), x)[1](ct)
    np.testing.assert_allclose(np.asarray(g), np.asarray(rotate(ct, cos, -sin)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmuls", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_model_multiplies_as_it_was_built_to_whatever_mesh_traces_it(matmuls):
    """The matmul implementation is the model's (``Llama(..., matmuls=)``), not the tracing mesh's: under a CPU
    mesh a model built with the GPU's matmuls traces plain dot_generals (no custom VJP anywhere), one built with
    the CPU's traces a custom VJP for each of its matmuls; blockwise FP8's 'auto' follows the same value."""
    cfg = tiny_config()
    layout = Layout.build(cfg, jax.devices()[:1])
    graphdef, params = nnx.split(Llama(cfg.model, rngs=nnx.Rngs(0), matmuls=matmuls))
    tokens = jnp.zeros((2, cfg.data.seq_len), jnp.int32)
    with layout.tracing():
        jaxpr = str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params))
    assert "dot_general" in jaxpr
    # per layer 7 projections and 2 attention contractions, once in the scanned body; the LM head
    assert jaxpr.count("custom_vjp_call") == (7 + 2 + 1 if matmuls.cpu else 0)
    with layout.tracing():
        assert fp8.Recipe("blockwise", matmuls=matmuls).blockwise().impl == ("xla" if matmuls.cpu else "pallas")
