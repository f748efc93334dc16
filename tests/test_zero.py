"""parallel.zero (ZeRO-1/2 over the data axis): the moments split over data while the params stay replicated,
the training equal to one device's (per-leaf gradients, losses, gradient norms, the params after 3 steps), one
all-gather per parameter in the step, and checkpoints that resume across zero settings."""

import re

import jax
import numpy as np
import pytest

from helpers import (NONZERO_LR, assert_same_params, assert_same_training, synthetic_batch, tiny_config,
                     training_record_with_params)
from jaxtron.checkpoint import Checkpointer
from jaxtron.config import ConfigError
from jaxtron.train.trainer import Trainer, put_batch


def config(*overrides):
    return tiny_config(*overrides, *NONZERO_LR)


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def reference():
    return training_record_with_params(config("parallel.data=1"), jax.devices()[:1])[0]


def test_bad_zero_is_one_line_error():
    with pytest.raises(ConfigError, match="parallel.zero"):
        tiny_config("parallel.zero=3")


@pytest.mark.parametrize("overrides", [("parallel.data=4", "parallel.fsdp=2", "parallel.zero=1"),
                                       # with accumulation: the accumulator is split over data too
                                       ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.zero=2",
                                        "train.micro_batch_size=1")],
                         ids=["data4-fsdp2-zero1", "data2-fsdp2-tensor2-zero2-accum2"])
def test_zero_matches_single_device(reference, overrides):
    got, trainer = training_record_with_params(config(*overrides), jax.devices())
    assert_same_training(got, reference)
    # 5e-5: Adam divides each element by its own gradient scale, which amplifies the fp32 reduction-order
    # differences (1e-5 in the gradients) of elements whose gradient is near zero
    assert_same_params(got["params"], reference["params"], rtol=5e-5)
    wq = trainer.state["params"]["layers"]["attention"]["wq"]
    mu = trainer.state["opt_state"][1][0].mu["layers"]["attention"]["wq"]
    assert "data" not in jax.tree.leaves(tuple(wq.sharding.spec))        # params: replicated over data
    assert "data" in jax.tree.leaves(tuple(mu.sharding.spec))            # moments: split over data too
    assert mu.addressable_shards[0].data.size * 2 <= wq.addressable_shards[0].data.size


def _steps(trainer, n):
    for i in range(n):
        trainer.step(put_batch(synthetic_batch(trainer.cfg, i), trainer.batch_sharding))


def test_zero2_gathers_the_params_once_and_checkpoints_resume_across_zero_settings(tmp_path):
    runs = {zero: Trainer(config("parallel.data=8", f"parallel.zero={zero}"), jax.devices()) for zero in (0, 2)}
    hlo = {zero: t.program.lower_train_step().compile().as_text() for zero, t in runs.items()}
    # the new parameters leave the step all-gathered over data, one all-gather per parameter (the CPU compiler
    # keeps the gradient's all-reduce + slice; XLA:GPU's ReduceScatterCreator is what turns it into a
    # reduce-scatter, so that is not checked here)
    gathers = {zero: len(re.findall(r" all-gather(?:-start)?\(", text)) for zero, text in hlo.items()}
    assert gathers == {0: 0, 2: len(jax.tree.leaves(runs[2].state["params"]))}
    for saved_by, restored_by in ((2, 0), (0, 2)):
        src, dst = runs[saved_by], runs[restored_by]
        _steps(src, 2)
        ckpt = Checkpointer(str(tmp_path / f"zero{saved_by}"))
        ckpt.save(int(src.state["step"]), src.state, {})
        ckpt.wait()
        dst.state, _ = ckpt.restore(int(src.state["step"]), dst.spec.abstract_state)
        ckpt.close()
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                     jax.device_get(dst.state), jax.device_get(src.state))
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, dst.state["opt_state"])) == jax.tree.leaves(
            dst.spec.state_shardings["opt_state"])
