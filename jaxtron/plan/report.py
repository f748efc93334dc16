"""Plan one layout: compile its train step for the target and report per-device memory (the compiler's own
analysis), FLOPs, the bytes each kind of collective moves (read from the optimized HLO), the roofline and the
op-by-op step model's step time."""

from __future__ import annotations

import copy
import time
from typing import Optional, Sequence

import jax
import numpy as np

from jaxtron.config import Config
from jaxtron.plan import model as pm
from jaxtron.plan import moe as pmoe
from jaxtron.plan import steptime
from jaxtron.plan.analysis import analyze
from jaxtron.plan.gpus import GpuSpec
from jaxtron.plan.latency_profile import write_profile
from jaxtron.plan.target import SORT_NOTE, compile_step, prepare_config, target_devices

PIPELINE_NOTE = ("pipeline stages: the step model counts the executed schedule (its idle ticks run the slowest "
                 "stage's work; with parallel.pipeline_recompute the stages' forward runs again in the "
                 "backward); the roofline's closed form has neither")
LATENCY_PROFILE_NOTE = ("latency profile: this compile's scheduler read the step model's costs of a first compile "
                        "from {path} (train.latency_profile; without it: without_latency_profile); train with "
                        "train.latency_profile={path} to compile the same schedule")
USABLE_NOTE = ("usable memory assumes XLA_PYTHON_CLIENT_MEM_FRACTION={} on the cluster (JAX preallocates 0.75 of "
               "GPU memory by default)")
# the analysis of the compiled module (jaxtron/plan/analysis.py), in the order plan() has always reported it
ANALYSIS_KEYS = ("moe", "flops", "collectives", "dots", "dots_moe_experts", "kernels", "async_overlap", "roofline",
                 "step_model")


def hardware(gpu: GpuSpec) -> dict:
    """The GPU figures the predictions assumed."""
    return {"peak_tflops": gpu.peak_tflops, "fp8_peak_tflops": gpu.fp8_peak_tflops, "hbm_gbps": gpu.hbm_gbps,
            "nvlink_gbps": gpu.nvlink_gbps, "net_gbps": gpu.net_gbps, "gpus_per_node": gpu.gpus_per_node,
            "compute_efficiency": gpu.compute_efficiency, "comm_efficiency": gpu.comm_efficiency,
            "collective_latency_us": gpu.collective_latency_us}


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


def layout_overrides(cfg: Config) -> str:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    mbs = t.micro_batch_size if t.micro_batch_size is not None else "null"
    ep = f"parallel.expert={p.expert} " if cfg.model.moe.num_experts else ""
    pp = (f"parallel.pipeline_schedule={p.pipeline_schedule} parallel.virtual_stages={p.virtual_stages} "
          + ("parallel.pipeline_fsdp_gather_once=true " if p.pipeline_fsdp_gather_once else "")
          if p.stage > 1 else "")
    return (f"parallel.data={p.data} parallel.fsdp={p.fsdp} {ep}parallel.context={p.context} "
            f"parallel.context_impl={p.context_impl} parallel.tensor={p.tensor} parallel.stage={p.stage} {pp}"
            f"parallel.sequence_parallel={str(p.sequence_parallel).lower()} train.micro_batch_size={mbs} "
            f"model.remat={m.remat}" + ("" if p.collective_pipelining else " parallel.collective_pipelining=false")
            + ("" if p.split_reduce_scatters else " parallel.split_reduce_scatters=false")
            + ("" if t.uninitialized_scan_outputs else " train.uninitialized_scan_outputs=false")
            + (f" train.latency_profile={t.latency_profile}" if t.latency_profile else ""))


def memory_report(mem, spec, gpu: GpuSpec, backend: str) -> dict:
    """Per-device bytes from the compiler's memory analysis, with the state's share and the fit verdict."""
    params_b = _shard_bytes(spec.abstract_state["params"])
    grads_b = params_b  # gradients have the params' shapes, dtype and sharding (they live in temp)
    arg, out, alias, temp = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                             mem.temp_size_in_bytes)
    peak_ma = getattr(mem, "peak_memory_in_bytes", 0) or 0
    return {
        "params": params_b, "optimizer": _shard_bytes(spec.abstract_state["opt_state"]), "grads": grads_b,
        "activations_and_temp": max(0.0, temp - grads_b), "temp": temp, "arguments": arg, "outputs": out,
        "aliased": alias, **peak_and_fit(arg, out, alias, temp, peak_ma if backend == "gpu" else 0, gpu),
    }


def peak_and_fit(arg: float, out: float, alias: float, temp: float, peak_ma: float, gpu: GpuSpec) -> dict:
    """The peak from the compiler's memory analysis (XLA:GPU's ``peak_memory_in_bytes`` when it gives one, else
    arguments + temp + the outputs not aliased to arguments) and whether it fits the GPU's usable memory."""
    peak = peak_ma if peak_ma > 0 else arg + temp + max(0, out - alias)
    usable = gpu.usable_bytes
    return {"peak": peak, "peak_from": "memory_analysis.peak_memory_in_bytes" if peak_ma > 0
            else "arguments + temp + unaliased outputs",
            "device_memory": gpu.memory_bytes, "usable": usable, "mem_fraction": gpu.mem_fraction,
            "fits": peak <= usable, "headroom": usable - peak}


def _attention_run(cfg: Config, compiled: Config) -> Optional[str]:
    """The attention kernel the cluster runs, where the compile put a stand-in kernel in its place (cuDNN as
    Pallas flash attention); None where the compile runs attention as GEMMs (the CPU compile's xla)."""
    if compiled.model.attention_impl in steptime.ATTENTION_TFLOPS:
        return cfg.model.attention_impl
    return None


def plan(cfg: Config, gpu: GpuSpec, num_gpus: int, backend: str = "auto", devices: Optional[Sequence] = None,
         keep_hlo: bool = False, moe_gemm: str = "as_compiled", latency_profile_out: Optional[str] = None) -> dict:
    """Compile ``cfg`` for ``num_gpus`` GPUs of kind ``gpu`` and report memory, FLOPs, communication and the
    roofline prediction. All byte figures are per device. MoE: ``moe_gemm`` says how the roofline runs the
    routed experts (``as_compiled`` or ``grouped``, :data:`jaxtron.plan.analysis.MOE_GEMM_NOTES`); the report
    has the other too. ``latency_profile_out``: write the step model's costs of this compile there as a latency
    profile for XLA:GPU's scheduler (jaxtron/plan/latency_profile.py), compile again with it
    (``train.latency_profile``) and report that compile, with the first one's step under
    ``without_latency_profile``. ``keep_hlo``: also the module's text, collectives and step-model costs per
    instruction (``_hlo``, ``_ops``; ``_latency_costs``, a function), for a caller that goes on with them."""
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
    # logical id i is mesh.devices.flat[i]; its node from the topology's process index (the CPU compile's
    # virtual devices: gpus_per_node consecutive ids per node)
    node_of = np.array([getattr(d, "process_index", d.id // gpu.gpus_per_node) if backend == "gpu"
                        else i // gpu.gpus_per_node for i, d in enumerate(layout.mesh.devices.flat)])
    a = analyze(ccfg, layout, gpu, text, node_of, moe_gemm, _attention_run(cfg, ccfg))
    moe = a["moe"] is not None
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
        **{k: a[k] for k in ANALYSIS_KEYS},
        "hardware": hardware(gpu),
        "notes": notes + a["notes"] + ([SORT_NOTE] if moe and backend == "gpu" else []) + [USABLE_NOTE.format(
            gpu.mem_fraction)] + ([PIPELINE_NOTE] if cfg.parallel.stage > 1 else []),
    }
    if keep_hlo:
        result["_hlo"] = text
        result["_ops"] = a["ops"]
        result["_latency_costs"] = a["latency_costs"]
    if latency_profile_out:
        result = plan_with_latency_profile(cfg, result["step_model"], a["latency_costs"](), latency_profile_out, gpu,
                                           num_gpus, backend, devices, keep_hlo, moe_gemm)
    return result


def plan_with_latency_profile(cfg: Config, first: dict, costs: dict, path: str, gpu: GpuSpec, num_gpus: int,
                              backend: str, devices: Optional[Sequence] = None, keep_hlo: bool = False,
                              moe_gemm: str = "as_compiled") -> dict:
    """:func:`plan` of ``cfg`` compiled with ``costs`` (a compile's step-model seconds per instruction, whose
    ``step_model`` was ``first``) written to ``path`` as its latency profile (``train.latency_profile``);
    ``first``'s step under ``without_latency_profile``."""
    if backend != "gpu":
        raise ValueError("--latency-profile-out needs the XLA:GPU compile (its scheduler reads the profile)")
    write_profile(costs, path)
    again = copy.deepcopy(cfg)
    again.train.latency_profile = path
    result = plan(again, gpu, num_gpus, backend, devices, keep_hlo, moe_gemm)
    result["without_latency_profile"] = {k: first[k] for k in ("step_time_s", "tokens_per_s_per_gpu",
                                                               "exposed_comm_s", "comm_s", "memory_bound_s")}
    result["latency_profile_file"] = path
    result["notes"].append(LATENCY_PROFILE_NOTE.format(path=path))
    return result
