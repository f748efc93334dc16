"""The stage backward split into B and W (jaxtron/parallel/backward_split.py), on a small stage: a loop over
layers (plain and rematerialized), bf16 weight casts, a weight shared by every layer (its gradient a carry of
the backward loop) and a weight outside the loop.

B then W gives the pullback's gradients; W's program holds only the weight-gradient matmuls (B's chain of input
cotangents does not run again) and B's only the input-gradient ones; nothing weight-shaped is stashed (W makes
the weights' casts again). The zb_h1 schedule built on it equals one device in tests/test_pipeline.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.parallel.residuals import KeptVJP

L, B, D, F = 3, 4, 8, 16


def _stage(remat: bool):
    def layer(h, w, mix):
        a = jnp.einsum("bd,df->bf", h.astype(jnp.bfloat16), w["up"].astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        a = jax.nn.silu(a)
        o = jnp.einsum("bf,fd->bd", a, w["down"], preferred_element_type=jnp.float32)
        return h + o + jnp.tanh(h) @ mix

    def fn(params, x, m, _select):
        body = lambda h, w: (layer(h, w, params["mix"]), None)
        if remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        y, _ = jax.lax.scan(body, x * (m + 1).astype(x.dtype), params["layers"])
        return y @ params["out"], jnp.sum(y)

    return fn


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {"layers": {"up": 0.3 * jax.random.normal(k[0], (L, D, F)),
                       "down": 0.3 * jax.random.normal(k[1], (L, F, D))},
            "mix": 0.2 * jax.random.normal(k[2], (D, D)), "out": 0.3 * jax.random.normal(k[3], (D, D))}


def _dots(jaxpr) -> int:
    return str(jaxpr).count("dot_general[")


@pytest.mark.parametrize("remat", [False, True], ids=["remat-none", "remat-full"])
def test_b_then_w_equals_the_pullback_and_w_runs_only_the_weight_gradient_matmuls(remat):
    fn, params = _stage(remat), _params()
    x = jax.random.normal(jax.random.key(1), (B, D))
    ct = jax.random.normal(jax.random.key(2), (B, D))
    m = jnp.int32(1)
    kept_vjp = KeptVJP(fn, params, x, m)
    split = kept_vjp.split(params, m)

    def whole(params, x, m, ct):
        _, _, kept = kept_vjp.forward(params, x, m)
        return kept_vjp.backward(params, kept, m, ct)

    def in_two(params, x, m, ct):
        _, _, kept = kept_vjp.forward(params, x, m)
        d_x, early, stash = split.input_part(params, kept, m, ct, ())
        late = split.weight_part(params, kept, m, ct, (), stash)
        return jax.tree.map(jnp.add, early, late), d_x

    want, got = jax.jit(whole)(params, x, m, ct), jax.jit(in_two)(params, x, m, ct)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want[0]["mix"]).sum()) > 0 and float(jnp.abs(want[1]).sum()) > 0

    kept = tuple(jnp.zeros(s.shape, s.dtype) for s in kept_vjp.kept_shapes)
    stash = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), split.stash_shapes)
    # W: per layer the up, down and mix weight gradients, and the head's: 3 dots in the loop body + 1
    w_jaxpr = jax.make_jaxpr(lambda: split.weight_part(params, kept, m, ct, (), stash))()
    assert _dots(w_jaxpr) == 4, w_jaxpr
    # B: the head's and per layer up's, down's and mix's input gradients (remat: and the up projection again,
    # the one forward dot whose output the backward reads); the forward traced for the weight-only residuals
    # is dead code B does not run
    b_jaxpr = jax.make_jaxpr(lambda: split.input_part(params, kept, m, ct, ())[0])()
    assert _dots(b_jaxpr) == (5 if remat else 4), b_jaxpr
    # the whole pullback, for comparison: every dot of both
    assert _dots(jax.make_jaxpr(lambda: kept_vjp.backward(params, kept, m, ct))()) > _dots(b_jaxpr)
    # the stash is per token (cotangents, activations), never a weight: W casts the weights again
    for s in jax.tree.leaves(split.stash_shapes):
        assert B in s.shape, split.stash_shapes
