"""Every parallel layout equals the single-device run: losses over 3 steps to 1e-5 relative (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import synthetic_batch, tiny_config
from jaxtron.train.loop import Run, put_batch
from jaxtron.train.state import abstract_train_state
from jaxtron.train.step import make_train_step


def run_losses(cfg, devices, steps=3):
    """Train ``steps`` steps on one fixed batch (so the loss must fall) and return the losses."""
    run = Run(cfg, devices)
    batch = put_batch(synthetic_batch(cfg, 0), run.batch_sharding)
    losses = []
    for _ in range(steps):
        run.state, m = run.train_step(run.state, batch)
        losses.append(float(m["loss"]))
    return np.array(losses), run


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_config("parallel.data=1")
    return run_losses(cfg, jax.devices()[:1])


LAYOUTS = [
    ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"),
    ("parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1"),
    ("parallel.data=2", "parallel.fsdp=1", "parallel.tensor=4"),
]


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(x.split(".")[1] for x in l))
def test_layout_matches_single_device(reference, layout, sequence_parallel):
    ref_losses, _ = reference
    cfg = tiny_config(*layout, f"parallel.sequence_parallel={sequence_parallel}")
    losses, run = run_losses(cfg, jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains


def test_params_are_created_sharded():
    cfg = tiny_config("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")
    run = Run(cfg, jax.devices())
    wq = run.state["params"]["layers"]["attention"]["wq"]      # [layers, embed, heads, head_dim]
    assert wq.sharding.spec == P("stage", "fsdp", "tensor", None)   # stage has size 1 here
    assert wq.addressable_shards[0].data.shape == (2, 32, 4, 8)
    mu = run.state["opt_state"][1][0].mu["layers"]["mlp"]["w_down"]  # Adam moments follow the params
    assert mu.sharding.spec == P("stage", "tensor", "fsdp")
    embed = run.state["params"]["embed"]
    assert embed.sharding.spec == P("tensor", "fsdp")


def _gradients(cfg, devices):
    """(gradients, metrics) of one train step from the initial params: the step's own gradient path, with an
    optimizer that stores the gradients in its state and leaves the params alone."""
    capture = optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))
    run = Run(cfg, devices)
    spec = abstract_train_state(cfg, capture, run.mesh, run.rules)
    step = make_train_step(cfg, spec, capture, run.schedule, run.mesh, run.rules, run.dp)
    state = jax.jit(spec.init_fn, out_shardings=spec.state_shardings)()
    state, metrics = step(state, put_batch(synthetic_batch(cfg, 0), run.batch_sharding))
    return state["opt_state"], metrics


def test_gradient_accumulation_equals_big_batch():
    """Accumulating 4 micro batches of 2 gives the gradient of the batch of 8 (up to fp32 summation order).

    Compared where that is exact: the losses, and the gradients and grad_norm at the same params. Params after
    several Adam steps are not compared: m / sqrt(v) turns a summation-order difference in a near-zero gradient
    into an O(lr) difference in the update."""
    big_cfg = tiny_config("parallel.data=1", "train.micro_batch_size=8")
    acc_cfg = tiny_config("parallel.data=1", "train.micro_batch_size=2")
    big, _ = run_losses(big_cfg, jax.devices()[:1])
    acc, _ = run_losses(acc_cfg, jax.devices()[:1])
    np.testing.assert_allclose(acc, big, rtol=1e-5)
    g_big, m_big = _gradients(big_cfg, jax.devices()[:1])
    g_acc, m_acc = _gradients(acc_cfg, jax.devices()[:1])
    np.testing.assert_allclose(float(m_acc["loss"]), float(m_big["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_acc["tokens"]), float(m_big["tokens"]), rtol=0)
    np.testing.assert_allclose(float(m_acc["grad_norm"]), float(m_big["grad_norm"]), rtol=1e-6)
    flat_big = jax.tree_util.tree_leaves_with_path(g_big)
    flat_acc = jax.tree.leaves(g_acc)
    assert len(flat_big) == len(flat_acc) > 0
    for (path, b), a in zip(flat_big, flat_acc):
        b, a = np.asarray(b, np.float64), np.asarray(a, np.float64)
        assert np.linalg.norm(b) > 0, path
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative gradient difference {err:.2e}"


def test_gradient_accumulation_with_data_parallel(reference):
    ref_losses, _ = reference
    losses, _ = run_losses(tiny_config("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                                       "train.global_batch_size=8", "train.micro_batch_size=1"), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_policies_do_not_change_the_numbers(reference, remat):
    ref_losses, _ = reference
    losses, _ = run_losses(tiny_config("parallel.data=1", f"model.remat={remat}"), jax.devices()[:1])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
