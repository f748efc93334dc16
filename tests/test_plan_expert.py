"""The planner with expert parallelism (issue 25): the closed forms of jaxtron/plan/moe.py for the expert-parallel
dispatch (state split over ``expert``, the masked expert matmuls on the exchange buffers, the all-to-all bytes)
against a compiled step's own numbers, ``--search`` trying the expert axis, and the ``ragged_all_to_all``
dispatch compiled by XLA:GPU for H100s (it cannot run on XLA:CPU) with the Pallas grouped matmul, whose kernels
the step model times as GEMMs."""

import pytest

from jaxtron import config as config_lib
from jaxtron.parallel.layout import Layout
from jaxtron.plan import candidate_configs, get_gpu
from jaxtron.plan import model as pm
from jaxtron.plan import moe as pmoe
from test_plan import MOE, _cli, _moe_by_hand, needs_xla_gpu

# ragged_dot, whose masked dense matmuls the HLO counts (gmm_impl=auto would take the Pallas kernel for GPUs)
EP = ("parallel.expert=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.data=1", "model.moe.ep_overlap=true",
      "model.moe.gmm_impl=ragged_dot")


@needs_xla_gpu
def test_expert_parallel_plan_matches_its_closed_forms():
    """expert 2 x fsdp 2 x tensor 2 compiled for 8 H100s (4 experts, 2 per rank, top-2, 16 x 32 tokens, bf16),
    with the overlapped dispatch: the compiled state, the expert matmul FLOPs counted in the HLO and the
    all-to-all bytes equal the closed forms the search ranks with (XLA:CPU would exchange the bf16 rows as
    fp32: twice the bytes), and XLA's schedule runs expert matmuls during some of the exchanges. XLA:GPU lowers
    ragged_dot to dense matmuls masked per expert, as XLA:CPU does (test_plan.py's dropless case)."""
    cfg = config_lib.load(None, MOE + list(EP))
    layout = Layout.planned(cfg, 8)
    r = _cli("--gpu", "h100", "--num-gpus", "8", *MOE, *EP)
    assert r["compiler"] == "XLA:GPU" and r["params"]["total"] == _moe_by_hand()[0]
    assert r["mesh"]["expert"] == 2 and "parallel.expert=2" in r["overrides"]
    state = pm.closed_form_state_bytes(cfg, layout)
    # the routed experts split over expert x fsdp x tensor, the rest over fsdp x tensor (norms and the router's
    # expert axis are not split: 2% more)
    assert r["memory"]["params"] == pytest.approx(state["params"], rel=0.02)
    no_ep = Layout.planned(config_lib.load(None, MOE + ["parallel.fsdp=2", "parallel.tensor=2"]), 8)
    assert state["params"] < pm.closed_form_state_bytes(cfg, no_ep)["params"]
    # each device keeps its 4 x 32 tokens and receives EP x C = 2 x 256 rows (worst case: C = t x min(k, 2)),
    # in two halves of 2 x 128
    assert pmoe.dispatch_rows(cfg, layout) == 2 * 256
    flops = r["moe"]["expert_matmul_flops_per_device"]
    executed = flops["as_compiled_hlo"]
    assert executed == pytest.approx(pmoe.expert_flops_per_device(cfg, layout, "as_compiled"), rel=0.01)
    # masked dense: each device multiplies the 2 x 256 rows it receives by both its experts (at half their width:
    # tensor 2), 4 x the active rows' FLOPs spread over the 8 devices
    assert executed == pytest.approx(4 * flops["grouped"], rel=0.01)
    a2a = r["collectives"]["all-to-all"]
    # the rows' exchanges; the slot ids and the counts (int32, one per row) add 1/32 of that
    assert pmoe.exchange_bytes(cfg, layout) <= a2a["wire_bytes"] <= 1.04 * pmoe.exchange_bytes(cfg, layout)
    assert r["roofline"]["exposed_comm_s"] > 0
    overlap = r["moe"]["all_to_all_overlapping_experts"]
    # (1 of 10 here; without ep_overlap 0 of 5)
    assert overlap["pairs"] == a2a["ops"] and overlap["with_expert_matmuls"] >= 1, overlap


def test_sequence_parallel_halves_the_rows_each_device_exchanges():
    """Under sequence parallelism each tensor rank dispatches its own half of the sequence at the experts' whole
    width (jaxtron/parallel/expert.py): the closed forms halve the exchanged rows and keep the FLOPs."""
    plain = config_lib.load(None, MOE + list(EP))
    sp = config_lib.load(None, MOE + list(EP) + ["parallel.sequence_parallel=true"])
    lp, ls = Layout.planned(plain, 8), Layout.planned(sp, 8)
    assert pmoe.dispatch_rows(sp, ls) * 2 == pmoe.dispatch_rows(plain, lp)
    assert pmoe.exchange_bytes(sp, ls) * 2 == pmoe.exchange_bytes(plain, lp)
    assert pmoe.expert_flops_per_device(sp, ls, "as_compiled") == pmoe.expert_flops_per_device(
        plain, lp, "as_compiled")


def test_search_tries_expert_sizes_that_divide_the_experts():
    cfg = config_lib.load(None, MOE + ["model.moe.num_experts=6"])
    sizes = {c.parallel.expert for c in candidate_configs(cfg, 8)}
    assert sizes == {1, 2}  # 6 experts: 4 and 8 do not divide them
    for c in candidate_configs(cfg, 8):
        assert c.parallel.data * c.parallel.fsdp * c.parallel.expert * c.parallel.tensor == 8
    capacity = config_lib.load(None, MOE + ["model.moe.dispatch=capacity"])
    assert {c.parallel.expert for c in candidate_configs(capacity, 8)} == {1}  # EP runs the dropless dispatch


def test_closed_form_ranks_expert_parallelism_first_for_qwen3_30b_a3b():
    """Without compiling: on 16 H100s the fastest Qwen3-30B-A3B candidate (exchange buffers of 1.25 x the
    balanced share: top-8 of 128 experts makes the worst case 16 x that) that the closed-form memory keeps
    splits the experts."""
    cfg = config_lib.load("qwen3_30b_a3b", ["model.moe.ep_capacity_factor=1.25"])
    gpu = get_gpu("h100")
    best = None
    for c in candidate_configs(cfg, 16):
        layout = Layout.planned(c, 16)
        if pm.closed_form_memory(c, layout)["total"] > gpu.usable_bytes:
            continue
        t = pm.closed_form_step_s(c, layout, gpu, 16, "grouped")
        best = min(best or (t, c), (t, c), key=lambda x: x[0])
    assert best is not None and best[1].parallel.expert > 1, best and best[1].parallel


@needs_xla_gpu
def test_xla_gpu_compiles_the_ragged_all_to_all_dispatch_with_the_pallas_grouped_matmul():
    """ep_dispatch=ragged_all_to_all and gmm_impl=pallas in the whole train step, lowered for cuda and
    compiled for 8 H100s: the exchanges are ragged all-to-alls and the expert matmuls Triton calls, which the step
    model times as GEMMs of their operands' shapes (forward gmm, dgrad gmm_t, wgrad tgmm: 2 x rows x K x N each;
    gate, up and down of the 2 MoE layers, 3 calls each)."""
    r = _cli("--gpu", "h100", "--num-gpus", "8", *MOE, "parallel.expert=4", "parallel.data=2",
             "model.moe.ep_dispatch=ragged_all_to_all", "model.moe.gmm_impl=pallas")
    assert r["compiler"] == "XLA:GPU" and r["memory"]["fits"] and r["mesh"]["expert"] == 4
    ragged = r["collectives"]["ragged-all-to-all"]
    assert ragged["ops"] >= 3, r["collectives"]  # rows, slot ids and results forward; their transposes
    assert r["moe"]["expert_matmul_flops_per_device"]["as_compiled_hlo"] == 0  # custom calls, not HLO dots
    sm = r["step_model"]
    kernels = {k: v for k, v in sm["gemm_top_shapes"].items() if k.startswith("kernel")}
    assert {k.split()[1] for k in kernels} >= {"gmm", "tgmm"}, sm["gemm_top_shapes"]
    rows, n, k = (int(x) for x in next(key for key in kernels if key.split()[1] == "gmm").split()[2].split("x"))
    d, f = 64, 32  # MOE's hidden size and expert width
    assert {n, k} == {d, f}
    assert sm["gemm"]["kernel_flops"] == pytest.approx(2 * 3 * 3 * 2.0 * rows * d * f)
    # ...so the roofline runs the kernel's active FLOPs (the closed form), as under --moe-gemm grouped
    cfg = config_lib.load(None, MOE + ["parallel.expert=4", "parallel.data=2"])
    grouped = pm.hardware_flops_per_device(cfg, Layout.planned(cfg, 8), "grouped")
    assert r["roofline"]["hardware_flops_per_device"] == pytest.approx(grouped, rel=1e-6)


def test_an_exchange_across_two_nodes_sends_only_its_off_node_share_over_the_network():
    """An all-to-all over 16 devices in 2 nodes of 8: each device sends 1/16 of its buffer to each peer, 8 of
    its 15 peers on the other node, so 8/15 of its wire bytes take the network while 7/15 take NVLink at the
    same time; an all-gather over the same devices is a ring whose every step crosses the network."""
    import numpy as np

    from jaxtron.plan import hlo, nccl

    cfg = config_lib.load(None, MOE + ["parallel.expert=4", "parallel.fsdp=4"])
    layout = Layout.planned(cfg, 16)
    gpu = get_gpu("h100")
    node_of = np.arange(16) // 8
    group = np.arange(16)[None]
    mib = 2.0**20
    ops = [hlo.CollectiveOp("x", kind, "c", 16 * mib, 16, 1.0, group) for kind in ("all-to-all", "all-gather")]
    (a2a, secs, net, nvl, _), (ag, ag_secs, ag_net, ag_nvl, _) = pm.collective_timing(cfg, layout, gpu, ops,
                                                                                       node_of, "as_compiled")
    wire = 16 * mib * 15 / 16
    assert (net, nvl) == pytest.approx((wire * 8 / 15, wire * 7 / 15))
    bw = 1e9 * gpu.comm_efficiency
    assert secs == pytest.approx(nccl.collective_seconds("all-to-all", 16, 2, net, nvl, gpu.net_gbps * bw,
                                                         gpu.nvlink_gbps * bw)[0] + gpu.collective_latency_us * 1e-6)
    assert secs > max(net / (gpu.net_gbps * bw), nvl / (gpu.nvlink_gbps * bw))
    assert (ag_net, ag_nvl) == (wire, 0.0) and ag_secs > secs
    # inside one node nothing crosses the network
    (_, _, net1, nvl1, _), _ = pm.collective_timing(cfg, layout, gpu, ops, np.zeros(16, int), "as_compiled")
    assert (net1, nvl1) == (0.0, pytest.approx(wire))
