"""FP8 recipes shaped for XLA's fusion (docs/fp8.md, "What XLA:GPU runs"): projections of one input share one
quantized copy (fp8.Recipe.projects / fp8.fp8_projects) with the results and gradients of separate projections,
and the remat policies keep the FP8 scales, so that the backward's recomputed casts take no amax again."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxtron.model import fp8, remat

SPECS = ("bsd,dhk->bshk", "bsd,dhk->bshk", "bsd,df->bsf")


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
    ws = (jnp.asarray(rng.standard_normal((32, 4, 8)) * 0.05, jnp.float32),
          jnp.asarray(rng.standard_normal((32, 2, 8)) * 0.07, jnp.float32),
          jnp.asarray(rng.standard_normal((32, 24)) * 0.03, jnp.float32))
    gs = tuple(jnp.asarray(rng.standard_normal((2, 8) + w.shape[1:]) * 1e-3, jnp.float32) for w in ws)
    # delayed: each projection's own history, the input column the same (they record the same amax of x)
    hists = tuple(jnp.asarray([[2.5, 0.2 * (i + 1), 3e-3], [3.0, 0.1, 1e-3]], jnp.float32) for i in range(3))
    return x, ws, gs, hists


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_projections_sharing_an_input_equal_separate_ones(recipe):
    """One quantized copy of x for three projections gives bit for bit the results, the input and weight
    gradients and (delayed) the recorded amaxes of three separate projections."""
    x, ws, gs, hists = _operands()

    def shared(x, ws, hists):
        hs = hists if recipe == "delayed" else (None,) * 3
        return fp8.fp8_projects(x, list(zip(SPECS, ws, hs)), recipe, margin=1)

    def separate(x, ws, hists):
        if recipe == "delayed":
            return [fp8.delayed_project(s, x, w, h, 1) for s, w, h in zip(SPECS, ws, hists)]
        return [fp8.fp8_project(s, x, w) for s, w in zip(SPECS, ws)]

    (ys, vjp_s), (yr, vjp_r) = jax.vjp(shared, x, ws, hists), jax.vjp(separate, x, ws, hists)
    for a, b in zip(ys, yr):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got, ref = vjp_s(list(gs)), vjp_r(list(gs))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(got[0]).max()) > 0  # the input's gradient flows past the shared cast
    if recipe == "delayed":
        np.testing.assert_allclose([np.asarray(h)[0, 0] for h in got[2]], float(jnp.abs(x).max()), rtol=1e-7)


def _subjaxprs(value):
    """The jaxprs in an equation's parameter (a jaxpr, a closed jaxpr, or tuples of them), by their fields, not
    by jax.core's classes (which newer JAX moves)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def _shapes(jaxpr, name):
    """The first operand's shape of every equation of primitive ``name`` in a jaxpr and the jaxprs inside it
    (remat, custom VJPs, pjit)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(tuple(eqn.invars[0].aval.shape))
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                found += _shapes(sub, name)
    return found


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_keeps_the_fp8_scales_for_the_backward(policy):
    """Under a recompute policy the backward recomputes x's FP8 copy with the forward's scale: the gradient
    program takes x's amax once (with the policy alone: twice, the backward reducing over the recomputed x
    again), the gradient's once, and the gradients are those without remat. The weight's amax is recomputed
    (a reduction over one shard; its all-reduce rides with the gradient's, fp8._current_dot)."""
    x, ws, gs, _ = _operands(1)
    w, g = ws[2], gs[2]

    def loss(x, w, fn):
        return jnp.vdot(fn(x, w), g)

    def project(x, w):
        return fp8.fp8_project(SPECS[2], jnp.tanh(x), w)  # x's producer is recomputed in the backward

    checkpointed = jax.checkpoint(project, policy=remat.POLICIES[policy])
    grad = jax.grad(loss, argnums=(0, 1))
    jaxpr = jax.make_jaxpr(lambda x, w: grad(x, w, checkpointed))(x, w).jaxpr
    assert len(_shapes(jaxpr, "tanh")) == 2  # recomputed in the backward: the test sees a remat
    amaxes = _shapes(jaxpr, "reduce_max")
    assert amaxes.count(x.shape) == 1 and amaxes.count(g.shape) == 1, amaxes
    assert amaxes.count(w.shape) == 2 and len(amaxes) == 4, amaxes
    for a, b in zip(grad(x, w, checkpointed), grad(x, w, project)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
