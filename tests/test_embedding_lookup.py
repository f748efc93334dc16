"""The token-embedding lookup per device (jaxtron/parallel/embedding.py): on a mesh whose batch axes split the
tokens (data 1 x fsdp 2 x expert 2 x tensor 2), its rows and the table's gradient equal jnp.take's on one
device, in fp32 and in bf16 (cast inside the shard_map on CPUs); without a mesh it is jnp.take."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from jaxtron.parallel.embedding import lookup
from jaxtron.parallel.layout import Layout

TABLE_NAMES = ("vocab", "act_embed")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lookup_on_a_mesh_has_the_rows_and_gradient_of_take(dtype):
    layout = Layout.build(tiny_config("parallel.data=1", "parallel.fsdp=2", "parallel.expert=2",
                                      "parallel.tensor=2", "model.moe.num_experts=4",
                                      "model.moe.num_experts_per_token=2"), jax.devices())
    rng = np.random.default_rng(0)
    table = rng.normal(size=(64, 16)).astype(np.float32)
    tokens = rng.integers(0, 64, size=(8, 12)).astype(np.int32)
    tokens[0, :3] = 5                                   # repeated tokens: their gradients add up
    probe = rng.normal(size=(8, 12, 16)).astype(np.float32)

    def loss(f):
        return lambda t: jnp.sum(f(t).astype(jnp.float32) * probe)

    def sharded(t):
        with layout.tracing():
            return lookup(t, jnp.asarray(tokens), dtype, TABLE_NAMES)

    plain = lambda t: jnp.take(t.astype(dtype), tokens, axis=0)  # noqa: E731
    with jax.set_mesh(layout.mesh):
        assert "shard_map" in str(jax.make_jaxpr(sharded)(table))   # the per-device path, not the fallback
        rows, grad = jax.jit(lambda t: (sharded(t), jax.grad(loss(sharded))(t)))(table)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(plain(table), np.float32))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(grad, jax.grad(loss(plain))(table), rtol=tol, atol=tol)


def test_lookup_without_a_mesh_is_take():
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    tokens = np.array([[1, 5, 1]], np.int32)
    np.testing.assert_array_equal(lookup(table, tokens, jnp.float32, TABLE_NAMES), table[tokens])
