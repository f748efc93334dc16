"""parallel.collective_pipelining: XLA:GPU's collective pipeliner options go to jax.jit with the train step, so
the trainer and the planner compile the same program. It trains like the single-device run (on XLA:CPU the
options are accepted and change nothing), and on an XLA:GPU compile the replay of the schedule shows the
pipelined gathers and reduce-scatters hidden under compute."""

import jax
import pytest

from helpers import NONZERO_LR, assert_same_training, tiny_config, training_record
from jaxtron.train.xla_options import PIPELINED_COLLECTIVES, compiler_options
from test_plan import SMALL, _cli, needs_xla_gpu


def test_the_options_are_asked_for_only_when_set():
    assert compiler_options(tiny_config()) is None
    assert compiler_options(tiny_config("parallel.collective_pipelining=true")) == PIPELINED_COLLECTIVES


def test_fsdp_with_collective_pipelining_trains_like_one_device():
    one = training_record(tiny_config(*NONZERO_LR, "parallel.data=1", "parallel.fsdp=1"), jax.devices()[:1])
    many = training_record(tiny_config(*NONZERO_LR, "parallel.data=1", "parallel.fsdp=8",
                                       "parallel.collective_pipelining=true"), jax.devices())
    assert_same_training(many, one, rtol=1e-4)


@needs_xla_gpu
def test_the_planner_sees_the_pipelined_collectives_hidden_under_compute():
    """FSDP 8 on 8 H100s, SMALL: the same wire time, less of it exposed, a shorter predicted step, and more
    memory for the buffers in flight; the override string carries the option."""
    args = ("--gpu", "h100", "--num-gpus", "8", *SMALL, "parallel.fsdp=8", "parallel.data=1")
    plain, piped = _cli(*args), _cli(*args, "parallel.collective_pipelining=true")
    a, b = plain["step_model"], piped["step_model"]
    assert b["comm_s"] == pytest.approx(a["comm_s"], rel=0.1)
    assert b["exposed_comm_s"] < 0.7 * a["exposed_comm_s"]
    assert b["step_time_s"] < a["step_time_s"]
    assert piped["memory"]["peak"] > plain["memory"]["peak"]
    assert "parallel.collective_pipelining=true" in piped["overrides"]
    assert "collective_pipelining" not in plain["overrides"]
