"""Every parallel layout equals the single-device run: losses over 3 steps to 1e-5 relative (fp32)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import synthetic_batch, tiny_config
from jaxtron.train.loop import Run, put_batch


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


def test_gradient_accumulation_equals_big_batch():
    big, run_big = run_losses(tiny_config("parallel.data=1", "train.micro_batch_size=8"), jax.devices()[:1])
    acc, run_acc = run_losses(tiny_config("parallel.data=1", "train.micro_batch_size=2"), jax.devices()[:1])
    np.testing.assert_allclose(acc, big, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5),
                 run_acc.state["params"], run_big.state["params"])


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
