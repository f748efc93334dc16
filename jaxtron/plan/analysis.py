"""What the planner reads from one optimized XLA:GPU module, whoever compiled it: dot FLOPs against the model's,
collectives by kind (timed by the mesh axes they span), kernels, async overlap, the roofline and the op-by-op
step model. :func:`jaxtron.plan.report.plan` runs it on the train step it compiles, and
:func:`jaxtron.plan.hlo_report.plan_hlo` on a module read from a file (a peer's program), so both are judged by
the same step model."""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxtron.config import Config
from jaxtron.parallel.layout import Layout
from jaxtron.plan import hlo, hlo_counts, steptime
from jaxtron.plan import model as pm
from jaxtron.plan import moe as pmoe
from jaxtron.plan.gpus import GpuSpec

MOE_GEMM_NOTES = {
    "as_compiled": "MoE: the roofline runs the routed experts as compiled, their FLOPs counted in the optimized "
                   "HLO: dropless jax.lax.ragged_dot is lowered by XLA to a group-masked dense matmul (E x a "
                   "grouped GEMM's FLOPs; E/parallel.expert with expert parallelism), capacity dispatch to "
                   "dense einsums over the capacity slots, on the rows each device gets (dropless: its own "
                   "tokens, or with parallel.expert its exchange buffers; capacity: GSPMD gathers the global "
                   "micro batch); the Pallas grouped GEMM (gmm_impl=pallas, and auto on GPUs) runs the active "
                   "FLOPs only",
    "grouped": "MoE: the roofline assumes a grouped-GEMM kernel (model.moe.gmm_impl=pallas or auto; timed on "
               "an H200, docs/performance.md) over a dispatch that keeps tokens on their device (dropless's): "
               "the routed experts execute their active FLOPs only; the expert-parallel all-to-all stays, "
               "GSPMD's dispatch collectives over the batch axes are left out; memory is still the compiled "
               "program's",
}

ASYNC_KINDS = ("all-gather", "all-reduce", "all-to-all", "collective-permute")


def moe_section(cfg: Config, layout: Layout, gpu: GpuSpec, ops, node_of, moe_gemm: str, expert_flops,
                text: str) -> dict:
    """The MoE part of a plan: which GEMM the roofline assumes, the routed experts' executed FLOPs, the
    prediction under the other assumption, and how many of the schedule's async all-to-alls have expert
    matmuls between start and done (the exchange overlapping the experts; the roofline does not count it)."""
    other = "grouped" if moe_gemm == "as_compiled" else "as_compiled"
    alt = pm.roofline(cfg, layout, gpu, ops, layout.num_devices, node_of, other,
                      None if pmoe.runs_grouped_kernel(cfg) else expert_flops)
    pairs = hlo_counts.async_overlap(text, "all-to-all", pmoe.EXPERT_MATMUL_OPS)
    e = cfg.model.moe
    return {
        "gemm": moe_gemm, "assumption": MOE_GEMM_NOTES[moe_gemm],
        "experts": e.num_experts, "top_k": e.num_experts_per_token, "dispatch": e.dispatch,
        "moe_layers": pm.moe_layer_count(cfg.model),
        "expert_matmul_flops_per_device": {"as_compiled_hlo": expert_flops,
                                           "grouped": pmoe.expert_flops_per_device(cfg, layout, "grouped")},
        "alternative": {"gemm": other, **{k: alt[k] for k in ("step_time_s", "tokens_per_s_per_gpu", "mfu",
                                                               "mfu_causal")}},
        "all_to_all_overlapping_experts": {"pairs": len(pairs), "with_expert_matmuls": sum(
            bool(p["marked_between"]) for p in pairs)},
    }


def flops_report(cfg: Config, roof: dict, hlo_matmul_flops: float, num_devices: int) -> dict:
    m, s = cfg.model, cfg.data.seq_len
    per_device = roof["model_flops_per_step"] / num_devices
    return {
        "model_flops_per_token": pm.flops_per_token(m, s, "full"),
        "model_flops_per_token_causal": pm.flops_per_token(m, s, "causal"),
        "matmul_flops_per_device_hlo": hlo_matmul_flops,
        "model_flops_per_step": roof["model_flops_per_step"],
        "model_flops_per_step_causal": roof["model_flops_per_step_causal"],
        "model_flops_per_device": per_device,
        # the compiled program's dots against the model's matmuls (full attention): above 1 for recomputation,
        # attention as dots over masked scores, padding; below 1 where kernels (flash attention) run matmuls
        # the HLO's dots do not carry
        "dot_over_model_flops": hlo_matmul_flops / per_device if per_device else 0.0,
        "hardware_flops_per_device": roof["hardware_flops_per_device"],
        "convention": "Megatron num_floating_point_operations (matmuls only, 3x forward; MoE: the top-k routed "
                      "and the shared experts, plus the router); 'full' counts the causal attention s^2 term "
                      "whole (Megatron's published tables), 'causal' halves it (Megatron's code today; what a "
                      "causal flash kernel executes)",
    }


def collective_seconds(cfg: Config, layout: Layout, gpu: GpuSpec, ops, node_of, moe_gemm: str) -> dict:
    """Each collective's link seconds per execution, keyed by (computation, name), for the step model."""
    return {(op.computation, op.name): secs
            for op, secs, *_ in pm.collective_timing(cfg, layout, gpu, ops, node_of, moe_gemm)}


def analyze(cfg: Config, layout: Layout, gpu: GpuSpec, text: str, node_of: np.ndarray,
            moe_gemm: str = "as_compiled", attention_impl: Optional[str] = None) -> dict:
    """The module's figures per device per step. ``cfg`` and ``layout`` describe the program (model FLOPs,
    tokens per step, the attention model, which mesh axes a replica group spans); ``node_of[i]``: the node of
    logical device i; ``attention_impl``: the attention kernel to time the module's attention calls as (None:
    ``cfg``'s). Whether attention's forward runs again in the backward is read from the module's kernel calls
    (twice as many forward passes as backward), not from ``model.remat``: under ``save_dots`` a flash kernel's
    output is no dot, so the compiled backward recomputes it; both programs of a comparison are timed by what
    they run. Keys: moe, flops, collectives, dots,
    dots_moe_experts, kernels, async_overlap, roofline, step_model, ops (the collectives, for callers that keep
    them), latency_costs (a function giving the step model's seconds per scheduled instruction, for a latency
    profile: jaxtron/plan/latency_profile.py) and notes."""
    n = layout.num_devices
    ops = hlo.collectives(text, n)
    collective_s = collective_seconds(cfg, layout, gpu, ops, node_of, moe_gemm)
    dots = hlo_counts.dot_flops(text, pmoe.EXPERT_MATMULS)
    moe = pm.moe_layer_count(cfg.model) > 0
    # the Pallas grouped GEMM's calls are no dots in the HLO: its FLOPs are the closed form's active ones
    expert_flops = dots["marked"] if moe and not pmoe.runs_grouped_kernel(cfg) else None
    roof = pm.roofline(cfg, layout, gpu, ops, n, node_of, moe_gemm, expert_flops)
    notes = [MOE_GEMM_NOTES[moe_gemm]] if moe else []
    unknown = hlo.unknown_trip_counts(hlo.parse_module(text))
    if unknown:
        notes.append(f"{len(unknown)} loop(s) without a readable trip count ({', '.join(unknown[:3])}) are counted "
                     "once by the step model: its time is a lower bound")
    return {
        "moe": moe_section(cfg, layout, gpu, ops, node_of, moe_gemm, dots["marked"], text) if moe else None,
        "flops": flops_report(cfg, roof, dots["total"], n),
        "collectives": hlo.summarize(ops),
        "dots": hlo_counts.dot_operand_types(text),
        "dots_moe_experts": hlo_counts.dot_operand_types(text, pmoe.EXPERT_MATMULS) if moe else None,
        "kernels": hlo_counts.kernel_calls(text),
        "async_overlap": {kind: {"pairs": len(ps), "exposed": sum(not p["compute_between"] for p in ps)}
                          for kind in ASYNC_KINDS for ps in [hlo_counts.async_overlap(text, kind)] if ps},
        "roofline": roof,
        "step_model": steptime.predict(cfg, text, gpu, collective_s, n, roof["model_flops_per_step"], attention_impl),
        "latency_costs": (lambda: steptime.latency_costs(cfg, text, gpu, collective_s, n, attention_impl)),
        "ops": ops,
        "notes": notes,
    }
