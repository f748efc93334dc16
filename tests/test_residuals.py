"""jaxtron/parallel/residuals.py: which VJP residuals a pipeline stage keeps per micro batch, and that the
backward from them equals jax.vjp's."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtron.parallel.residuals import KeptVJP


def _stage(w, x, m, _select):
    """A scanned stack of layers that cast their weights to bf16 (as the model's layers do) and read the micro
    batch index through a cond, the way a stage's mask or positions do."""
    def layer(h, wl):
        y = jnp.tanh(h @ wl.astype(jnp.bfloat16).astype(jnp.float32))
        return lax.cond(m > 0, lambda: y * 2.0, lambda: y), None
    y, _ = lax.scan(layer, x, w)
    return (y, jnp.sum(y ** 2)), {"mean": jnp.mean(y)}


def test_weight_casts_are_made_again_and_activations_kept():
    w = jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    m = jnp.int32(1)
    kept = KeptVJP(_stage, w, x, m)
    _, pullback, _ = jax.vjp(lambda w, x: _stage(w, x, m, ()), w, x, has_aux=True)
    leaves = jax.tree.leaves(pullback)
    casts = [leaf.shape == w.shape for leaf in leaves]
    assert any(casts)                                                    # the stacked bf16-cast weights...
    assert not any(k for k, c in zip(kept.keep, casts) if c)             # ...are not kept per micro batch
    assert sum(kept.keep) >= 2 and kept.kept_bytes() < sum(leaf.nbytes for leaf in leaves)

    out, aux, res = jax.jit(kept.forward)(w, x, m)
    ct = (jax.random.normal(jax.random.key(2), (4, 8)), jnp.float32(1.0))
    got = jax.jit(kept.backward)(w, res, m, ct)
    want = pullback(ct)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    np.testing.assert_allclose(aux["mean"], jnp.mean(out[0]), rtol=1e-6)
