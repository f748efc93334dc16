"""Plan one layout: compile its train step for the target and report per-device memory (the compiler's own
analysis), FLOPs, the bytes each kind of collective moves (read from the optimized HLO), the roofline and the
op-by-op step model's step time."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import numpy as np

from jaxtron.config import Config
from jaxtron.parallel.layout import Layout
from jaxtron.plan import hlo, hlo_counts, steptime
from jaxtron.plan import model as pm
from jaxtron.plan import moe as pmoe
from jaxtron.plan.gpus import GpuSpec
from jaxtron.plan.target import SORT_NOTE, compile_step, prepare_config, target_devices

PIPELINE_NOTE = ("pipeline stages: the step model counts the executed schedule (its idle ticks run the slowest "
                 "stage's work, the stages' forward recomputed in the backward); the roofline's closed form "
                 "has neither")



def _shard_bytes(tree) -> float:
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += float(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


def _count(tree) -> int:
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(tree)))


def check_moe_gemm(moe_gemm: str) -> None:
    if moe_gemm not in pmoe.GEMMS:
        raise ValueError(f"--moe-gemm: must be one of {', '.join(pmoe.GEMMS)}, got {moe_gemm!r}")


MOE_GEMM_NOTES = {
    "as_compiled": "MoE: the roofline runs the routed experts as compiled, their FLOPs counted in the optimized "
                   "HLO: dropless jax.lax.ragged_dot is lowered by XLA to a group-masked dense matmul (E x a "
                   "grouped GEMM's FLOPs; E/parallel.expert with expert parallelism), capacity dispatch to "
                   "dense einsums over the capacity slots, on the rows each device gets (dropless: its own "
                   "tokens, or with parallel.expert its exchange buffers; capacity: GSPMD gathers the global "
                   "micro batch)",
    "grouped": "MoE: the roofline assumes a grouped-GEMM kernel (model.moe.gmm_impl=pallas; not timed on a "
               "GPU) over a dispatch that keeps tokens on their device (dropless's): "
               "the routed experts execute their active FLOPs only; the expert-parallel all-to-all stays, "
               "GSPMD's dispatch collectives over the batch axes are left out; memory is still the compiled "
               "program's",
}


def moe_section(cfg: Config, layout: Layout, gpu: GpuSpec, ops, node_of, moe_gemm: str, expert_flops,
                text: str) -> dict:
    """The MoE part of a plan: which GEMM the roofline assumes, the routed experts' executed FLOPs, the
    prediction under the other assumption, and how many of the schedule's async all-to-alls have expert
    matmuls between start and done (the exchange overlapping the experts; the roofline does not count it)."""
    other = "grouped" if moe_gemm == "as_compiled" else "as_compiled"
    alt = pm.roofline(cfg, layout, gpu, ops, layout.num_devices, node_of, other, expert_flops)
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


def layout_overrides(cfg: Config) -> str:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    mbs = t.micro_batch_size if t.micro_batch_size is not None else "null"
    ep = f"parallel.expert={p.expert} " if cfg.model.moe.num_experts else ""
    pp = (f"parallel.pipeline_schedule={p.pipeline_schedule} parallel.virtual_stages={p.virtual_stages} "
          if p.stage > 1 else "")
    return (f"parallel.data={p.data} parallel.fsdp={p.fsdp} {ep}parallel.context={p.context} "
            f"parallel.context_impl={p.context_impl} parallel.tensor={p.tensor} parallel.stage={p.stage} {pp}"
            f"parallel.sequence_parallel={str(p.sequence_parallel).lower()} train.micro_batch_size={mbs} "
            f"model.remat={m.remat}" + (" parallel.collective_pipelining=true" if p.collective_pipelining else ""))


def memory_report(mem, spec, gpu: GpuSpec, backend: str) -> dict:
    """Per-device bytes from the compiler's memory analysis, with the state's share and the fit verdict."""
    params_b = _shard_bytes(spec.abstract_state["params"])
    grads_b = params_b  # gradients have the params' shapes, dtype and sharding (they live in temp)
    arg, out, alias, temp = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                             mem.temp_size_in_bytes)
    peak_ma = getattr(mem, "peak_memory_in_bytes", 0) or 0
    peak = peak_ma if backend == "gpu" and peak_ma > 0 else arg + temp + max(0, out - alias)
    usable = gpu.usable_bytes
    return {
        "params": params_b, "optimizer": _shard_bytes(spec.abstract_state["opt_state"]), "grads": grads_b,
        "activations_and_temp": max(0.0, temp - grads_b), "temp": temp, "arguments": arg, "outputs": out,
        "aliased": alias, "peak": peak, "peak_from": "memory_analysis.peak_memory_in_bytes" if peak == peak_ma
        else "arguments + temp + unaliased outputs",
        "device_memory": gpu.memory_bytes, "usable": usable, "mem_fraction": gpu.mem_fraction,
        "fits": peak <= usable, "headroom": usable - peak,
    }


def flops_report(cfg: Config, roof: dict, hlo_matmul_flops: float, num_devices: int) -> dict:
    m, s = cfg.model, cfg.data.seq_len
    return {
        "model_flops_per_token": pm.flops_per_token(m, s, "full"),
        "model_flops_per_token_causal": pm.flops_per_token(m, s, "causal"),
        "matmul_flops_per_device_hlo": hlo_matmul_flops,
        "model_flops_per_step": roof["model_flops_per_step"],
        "model_flops_per_step_causal": roof["model_flops_per_step_causal"],
        "model_flops_per_device": roof["model_flops_per_step"] / num_devices,
        "hardware_flops_per_device": roof["hardware_flops_per_device"],
        "convention": "Megatron num_floating_point_operations (matmuls only, 3x forward; MoE: the top-k routed "
                      "and the shared experts, plus the router); 'full' counts the causal attention s^2 term "
                      "whole (Megatron's published tables), 'causal' halves it (Megatron's code today; what a "
                      "causal flash kernel executes)",
    }


def _attention_run(cfg: Config, compiled: Config) -> Optional[str]:
    """The attention kernel the cluster runs, where the compile put a stand-in kernel in its place (cuDNN as
    Pallas flash attention); None where the compile runs attention as GEMMs (the CPU compile's xla)."""
    if compiled.model.attention_impl in steptime.ATTENTION_TFLOPS:
        return cfg.model.attention_impl
    return None


def _collective_seconds(cfg: Config, layout: Layout, gpu: GpuSpec, ops, node_of, moe_gemm: str) -> dict:
    """Each collective's link seconds per execution, keyed by (computation, name), for the step model."""
    return {(op.computation, op.name): secs
            for op, secs, *_ in pm.collective_timing(cfg, layout, gpu, ops, node_of, moe_gemm)}


def plan(cfg: Config, gpu: GpuSpec, num_gpus: int, backend: str = "auto", devices: Optional[Sequence] = None,
         keep_hlo: bool = False, moe_gemm: str = "as_compiled") -> dict:
    """Compile ``cfg`` for ``num_gpus`` GPUs of kind ``gpu`` and report memory, FLOPs, communication and the
    roofline prediction. All byte figures are per device. MoE: ``moe_gemm`` says how the roofline runs the
    routed experts (``as_compiled`` or ``grouped``, :data:`MOE_GEMM_NOTES`); the report has the other too."""
    check_moe_gemm(moe_gemm)
    notes: list[str] = []
    if devices is None:
        devices, backend, dev_notes = target_devices(gpu, num_gpus, backend)
        notes += dev_notes
    else:
        backend = "gpu" if devices[0].platform in ("gpu", "cuda") else "cpu"
    ccfg, cfg_notes = prepare_config(cfg, backend)
    notes += cfg_notes
    t0 = time.perf_counter()
    compiled, spec, layout = compile_step(ccfg, devices)
    compile_s = time.perf_counter() - t0
    memory = memory_report(compiled.memory_analysis(), spec, gpu, backend)
    text = compiled.as_text()
    ops = hlo.collectives(text, len(devices))
    # logical id i is mesh.devices.flat[i]; its node from the topology's process index (the CPU compile's
    # virtual devices: gpus_per_node consecutive ids per node)
    node_of = np.array([getattr(d, "process_index", d.id // gpu.gpus_per_node) if backend == "gpu"
                        else i // gpu.gpus_per_node for i, d in enumerate(layout.mesh.devices.flat)])
    dots = hlo_counts.dot_flops(text, pmoe.EXPERT_MATMULS)
    moe = pm.moe_layer_count(ccfg.model) > 0
    roof = pm.roofline(ccfg, layout, gpu, ops, len(devices), node_of, moe_gemm, dots["marked"] if moe else None)
    if moe:
        notes += [MOE_GEMM_NOTES[moe_gemm]] + ([SORT_NOTE] if backend == "gpu" else [])
    unknown = hlo.unknown_trip_counts(hlo.parse_module(text))
    if unknown:
        notes.append(f"{len(unknown)} loop(s) without a readable trip count ({', '.join(unknown[:3])}) are counted "
                     "once by the step model: its time is a lower bound")
    result = {
        "gpu": gpu.name, "gpu_description": gpu.description, "num_gpus": len(devices),
        "nodes": max(1, len(devices) // gpu.gpus_per_node), "compiler": "XLA:GPU" if backend == "gpu" else "XLA:CPU",
        "compile_s": compile_s, "mesh": dict(layout.sizes), "layout": layout.describe(),
        "overrides": layout_overrides(cfg),
        "micro_batch_size": layout.micro_batch_size, "accumulation_steps": layout.accumulation_steps,
        "global_batch_size": ccfg.train.global_batch_size, "seq_len": ccfg.data.seq_len,
        "attention_impl": ccfg.model.attention_impl, "remat": ccfg.model.remat,
        "memory": memory,
        "closed_form_memory": pm.closed_form_memory(ccfg, layout),
        "params": {"total": _count(spec.abstract_state["params"]), "closed_form": pm.param_count(ccfg.model),
                   "active_per_token": pm.param_count(ccfg.model, active=True)},
        "moe": moe_section(ccfg, layout, gpu, ops, node_of, moe_gemm, dots["marked"], text) if moe else None,
        "flops": flops_report(ccfg, roof, dots["total"], len(devices)),
        "collectives": hlo.summarize(ops),
        "dots": hlo_counts.dot_operand_types(text),
        "dots_moe_experts": hlo_counts.dot_operand_types(text, pmoe.EXPERT_MATMULS) if moe else None,
        "kernels": hlo_counts.kernel_calls(text),
        "async_overlap": {kind: {"pairs": len(ps), "exposed": sum(not p["compute_between"] for p in ps)}
                          for kind in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
                          for ps in [hlo_counts.async_overlap(text, kind)] if ps},
        "roofline": roof,
        "step_model": steptime.predict(ccfg, text, gpu, _collective_seconds(ccfg, layout, gpu, ops, node_of, moe_gemm),
                                       len(devices), roof["model_flops_per_step"], _attention_run(cfg, ccfg)),
        "hardware": {"peak_tflops": gpu.peak_tflops, "fp8_peak_tflops": gpu.fp8_peak_tflops, "hbm_gbps": gpu.hbm_gbps,
                     "nvlink_gbps": gpu.nvlink_gbps,
                     "net_gbps": gpu.net_gbps, "gpus_per_node": gpu.gpus_per_node,
                     "compute_efficiency": gpu.compute_efficiency, "comm_efficiency": gpu.comm_efficiency,
                     "collective_latency_us": gpu.collective_latency_us},
        "notes": notes + [f"usable memory assumes XLA_PYTHON_CLIENT_MEM_FRACTION={gpu.mem_fraction} on the cluster "
                          "(JAX preallocates 0.75 of GPU memory by default)"]
                 + ([PIPELINE_NOTE] if cfg.parallel.stage > 1 else []),
    }
    if keep_hlo:
        result["_hlo"] = text
        result["_ops"] = ops
    return result
