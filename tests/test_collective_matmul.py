"""Collective matmul (``parallel.tp_comm_overlap``, jaxtron/parallel/collective_matmul.py): tensor-parallel
layouts with sequence parallelism whose column-parallel projections all-gather, and whose row-parallel ones
reduce-scatter, the sequence in ppermute ring steps train exactly as one device does (``assert_same_training``:
losses of 3 steps with a non-zero learning rate, gradient norms and every gradient leaf, fp32, 1e-5), and the
program they compile really holds the rings. Which projections take the ring is decided from the weight's
logical names; the cases that keep the plain path (FP8, a sequence that does not split, no sequence
parallelism) are checked on the decision itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import NONZERO_LR, assert_same_training, synthetic_batch, tiny_config, training_record_with_params
from jaxtron.parallel import collective_matmul
from jaxtron.parallel.layout import Layout
from jaxtron.train.trainer import put_batch

SP = ("parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true")
LAYOUTS = {
    "data4-tensor2": ("parallel.data=4", "parallel.tensor=2", *SP),
    "data2-tensor4": ("parallel.data=2", "parallel.tensor=4", *SP),
    "data2-fsdp2-tensor2": ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", *SP),
}


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def one_device():
    return training_record_with_params(tiny_config(*NONZERO_LR), jax.devices()[:1])[0]


@pytest.mark.parametrize("layout", ["data2-tensor4", "data2-fsdp2-tensor2"])  # rings of 4 and of 2 steps
def test_collective_matmul_trains_like_one_device(layout, one_device):
    cfg = tiny_config(*NONZERO_LR, *LAYOUTS[layout])
    record, trainer = training_record_with_params(cfg, jax.devices())
    assert_same_training(record, one_device, rtol=1e-5)
    # the rings are there: per layer 7 projections (q, k, v, gate, up: all-gather; out, down: reduce-scatter)
    # in 2 shared rings and 2 single ones, each of tensor - 1 transfers in the forward and as many backward
    batch = put_batch(synthetic_batch(cfg, 0), trainer.batch_sharding)
    text = trainer.train_step.lower(trainer.state, batch).as_text()
    assert text.count("stablehlo.collective_permute") >= 2 * 4 * (cfg.parallel.tensor - 1)


def _decisions(*overrides, seq=16):
    """The decision of collective_matmul.plan for (column, row)-parallel projections under a layout's rules."""
    cfg = tiny_config("parallel.data=4", "parallel.tensor=2", *overrides)
    layout = Layout.build(cfg, jax.devices())
    with layout.tracing():
        column = collective_matmul.plan("bsd,dhk->bshk", (2, seq, 64), ("embed", "heads", "head_dim"))
        row = collective_matmul.plan("bsf,fd->bsd", (2, seq, 128), ("mlp", "embed"))
        latent = collective_matmul.plan("bsd,dc->bsc", (2, seq, 64), ("embed", "kv_lora"))
    return column and column[0], row and row[0], latent


def test_collective_matmul_decision():
    assert _decisions(*SP) == ("gather", "scatter", None)
    assert _decisions(*SP, seq=1) == (None, None, None)  # decoding: one token does not split over tensor
    assert _decisions("parallel.sequence_parallel=true") == ("gather", "scatter", None)  # on by default
    assert _decisions("parallel.sequence_parallel=true", "parallel.tp_comm_overlap=false") == (None, None, None)
    assert _decisions("parallel.tp_comm_overlap=true") == (None, None, None)  # no sequence parallelism


def test_fp8_keeps_the_plain_path(caplog):
    """FP8 projections under tp_comm_overlap keep the plain path (projects says None), and say so once; the
    same projections unquantized take one shared ring whose results equal the einsums."""
    cfg = tiny_config("parallel.data=4", "parallel.tensor=2", *SP)
    layout = Layout.build(cfg, jax.devices())
    x = jax.random.normal(jax.random.key(0), (4, 16, 64))
    wq, wk = jax.random.normal(jax.random.key(1), (64, 8, 8)), jax.random.normal(jax.random.key(2), (64, 4, 8))
    ops = lambda wq, wk: [("bsd,dhk->bshk", wq, ("embed", "heads", "head_dim")),  # noqa: E731
                          ("bsd,dhk->bshk", wk, ("embed", "kv_heads", "head_dim"))]
    with layout.tracing(), caplog.at_level("INFO"):
        for _ in range(2):
            assert collective_matmul.projects(x, ops(wq, wk), jnp.einsum, quantized=True) is None
        q, k = jax.jit(lambda x, wq, wk: collective_matmul.projects(x, ops(wq, wk), jnp.einsum))(x, wq, wk)
    assert sum("FP8" in r.message for r in caplog.records) == 1
    np.testing.assert_allclose(q, jnp.einsum("bsd,dhk->bshk", x, wq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, jnp.einsum("bsd,dhk->bshk", x, wk), rtol=1e-5, atol=1e-5)
