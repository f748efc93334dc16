"""Every parallel layout trains exactly as one device does.

Compared at identical parameters: the fp32 gradient of the whole batch leaf by leaf (relative L2 error) and its
global norm; then the losses and gradient norms of 3 optimizer steps with a non-zero learning rate from step
0 (``helpers.NONZERO_LR``), all to 1e-5 relative in fp32. Losses alone would not do: one Adam step depends
only on the gradient's sign, so a layout that sums instead of averaging over data parallelism would pass.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import NONZERO_LR, assert_same_training, tiny_config, training_record
from jaxtron.train.trainer import Trainer


def config(*overrides):
    return tiny_config(*overrides, *NONZERO_LR)


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def reference():
    return training_record(config("parallel.data=1"), jax.devices()[:1])


LAYOUTS = {
    "data2-fsdp2-tensor2": ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"),
    "data2-fsdp2-tensor2-sp": ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                               "parallel.sequence_parallel=true"),
    "fsdp8": ("parallel.data=1", "parallel.fsdp=8"),
    "data2-tensor4-sp": ("parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true"),
    # 4 micro batches of 1 row per replica: accumulation inside a sharded step
    "data2-fsdp2-tensor2-accum4": ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                                   "train.micro_batch_size=1"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(reference, name):
    assert_same_training(training_record(config(*LAYOUTS[name]), jax.devices()), reference)


def test_params_are_created_sharded():
    trainer = Trainer(config("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"), jax.devices())
    wq = trainer.state["params"]["layers"]["attention"]["wq"]      # [layers, embed, heads, head_dim]
    # stage and context have size 1 here; ZeRO-3 spans fsdp x context
    assert wq.sharding.spec == P("stage", ("fsdp", "context"), "tensor", None)
    assert wq.addressable_shards[0].data.shape == (2, 32, 4, 8)
    mu = trainer.state["opt_state"][1][0].mu["layers"]["mlp"]["w_down"]  # Adam moments follow the params
    assert mu.sharding.spec == P("stage", "tensor", ("fsdp", "context"))
    embed = trainer.state["params"]["embed"]
    assert embed.sharding.spec == P("tensor", ("fsdp", "context"))


def test_gradient_accumulation_equals_big_batch(reference):
    """Accumulating 4 micro batches of 2 on one device gives the gradient of the batch of 8 (up to fp32
    summation order), and so the same training."""
    acc = training_record(config("parallel.data=1", "train.micro_batch_size=2"), jax.devices()[:1])
    assert_same_training(acc, reference)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_policies_do_not_change_the_numbers(reference, remat):
    got = training_record(config("parallel.data=1", f"model.remat={remat}"), jax.devices()[:1])
    assert_same_training(got, reference, rtol=1e-6)
