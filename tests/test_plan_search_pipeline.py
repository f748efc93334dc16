"""--search's closed forms under pipeline stages (no compiles): what a stage sends is its own layers', and the
once-per-step FSDP gather of a stage's weights is tried and counted."""

from jaxtron.config import load
from jaxtron.parallel.layout import Layout
from jaxtron.plan import model as pm
from jaxtron.plan.gpus import get_gpu
from jaxtron.plan.search import candidate_configs


def _planned(overrides, num_gpus=64):
    cfg = load("llama3_70b", ["parallel.data=1", "parallel.fsdp=1", *overrides])
    return cfg, Layout.planned(cfg, num_gpus)


def test_search_tries_the_stage_gather_once_only_where_it_applies():
    cfg = load("llama3_70b")
    seen = {(c.parallel.stage > 1, c.parallel.fsdp > 1, c.parallel.pipeline_fsdp_gather_once)
            for c in candidate_configs(cfg, 64)}
    assert (True, True, True) in seen and (True, True, False) in seen
    assert (False, True, True) not in seen and (True, False, True) not in seen


def test_a_stage_sends_only_its_own_layers_tensor_parallel_traffic():
    gpu = get_gpu("h100")
    # the same micro batches (data 1) on tensor 8: one node, or 8 stages of it
    flat = pm.closed_form_comm_s(*_planned(["parallel.tensor=8"], 8), gpu, 8)
    staged = pm.closed_form_comm_s(*_planned(["parallel.tensor=8", "parallel.stage=8"]), gpu, 64)
    assert abs(staged - flat / 8) < 1e-9 * flat


def test_gathering_a_stage_once_trades_memory_for_network_time():
    gpu = get_gpu("h100").replace(net_gbps=5.0)
    base = ["parallel.tensor=4", "parallel.stage=4", "parallel.fsdp=4"]
    per_tick, once = _planned(base), _planned(base + ["parallel.pipeline_fsdp_gather_once=true"])
    # 32 micro batches: per tick the fsdp gathers cross the slow network 32 times, once per step they hide
    # under the compute
    assert pm.closed_form_step_s(*once, gpu, 64) < 0.5 * pm.closed_form_step_s(*per_tick, gpu, 64)
    # the stage's 20 layers held gathered over fsdp: bf16 weights and fp32 gradients, 6 bytes a parameter
    stage_params = pm.param_count(once[0].model) / (4 * 4)
    grown = pm.closed_form_memory(*once)["total"] - pm.closed_form_memory(*per_tick)["total"]
    assert 0.7 * 6 * stage_params < grown < 6 * stage_params
