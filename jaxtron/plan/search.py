"""``python -m jaxtron.plan --search``: enumerate layouts, prune and order them by closed forms, compile the
chosen ones with :func:`jaxtron.plan.plan` and rank those that fit by the step model."""

from __future__ import annotations

import copy
import itertools
import math
import os
import time
from typing import Optional, Sequence

from jaxtron import preflight
from jaxtron.config import Config, ConfigError, validate
from jaxtron.parallel.axes import DATA, EXPERT, FSDP, data_parallel_size
from jaxtron.parallel.layout import Layout
from jaxtron.plan.report import PIPELINE_NOTE, check_moe_gemm, layout_overrides, plan, plan_with_latency_profile
from jaxtron.plan.target import prepare_config, target_devices
from jaxtron.plan import model as pm
from jaxtron.plan import moe as pmoe
from jaxtron.plan.gpus import GpuSpec

LONG_CONTEXT = 16384  # --search tries context parallelism from this sequence length on


def contexts(cfg: Config, devices: int) -> list[int]:
    """Context sizes --search tries: 1, and for long sequences every divisor that splits seq into 2C chunks."""
    if cfg.data.seq_len < LONG_CONTEXT:
        return [1]
    return [c for c in pm.divisors(devices) if cfg.data.seq_len % (2 * c) == 0 or c == 1]


def _stages(cfg: Config, devices: int, context: int) -> list[int]:
    """Pipeline sizes --search tries: 1, and (1f1b, context 1) every divisor of the devices that splits the
    layers evenly, up to 16."""
    if context > 1:  # ring attention does not run under stages
        return [1]
    return [s for s in pm.divisors(devices) if s <= 16 and cfg.model.num_layers % s == 0]


def _schedules(num_layers: int, stage: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) --search tries under ``stage`` > 1 stages: 1f1b, gpipe, circular with every
    virtual stage count from 2 to 8 that splits the layers into ``stage x virtual`` equal chunks, and zbv where
    the layers split into its 2 x stage chunks."""
    if stage <= 1:
        return [("1f1b", 1)]
    return [("1f1b", 1), ("gpipe", 1)] + [("circular", v) for v in range(2, 9) if num_layers % (v * stage) == 0] \
        + ([("zbv", 1)] if num_layers % (2 * stage) == 0 else [])


def candidate_configs(cfg: Config, num_gpus: int, gpus_per_node: int = 8,
                      remats: Sequence[str] = ("none", "save_dots", "full"),
                      fp8_recipes: Optional[Sequence[str]] = None) -> list[Config]:
    """Layouts for --search (module doc of docs/planner.md); ``fp8_recipes``: the ``model.fp8`` values to try
    (default: the config's only)."""
    m, gbs = cfg.model, cfg.train.global_batch_size
    fp8s = list(dict.fromkeys(fp8_recipes or [m.fp8]))
    out = []
    widths = [m.num_heads, m.num_kv_heads, m.intermediate_size]  # what tensor parallelism splits
    if m.moe.num_experts:
        widths += [m.moe.expert_intermediate_size, pmoe.shared_width(m) or m.moe.expert_intermediate_size]
    splits = [(t, c, st) for t in pm.divisors(num_gpus)
              if t <= gpus_per_node and not any(w % t for w in widths)
              for c in contexts(cfg, num_gpus // t) for st in _stages(cfg, num_gpus // (t * c), c)]
    num_experts = m.moe.num_experts if m.moe.dispatch == "dropless" else 0  # EP runs the dropless dispatch
    for tensor, context, stage in splits:
        rest = num_gpus // (tensor * context * stage)
        for expert, fsdp in [(e, f) for e in pm.divisors(rest) if e == 1 or (num_experts and num_experts % e == 0)
                             for f in pm.divisors(rest // e)]:
            data = rest // (expert * fsdp)
            dp = data_parallel_size({DATA: data, FSDP: fsdp, EXPERT: expert})
            if gbs % dp:
                continue
            # a pipeline needs at least as many micro batches as stages
            mbs_opts = [b for b in pm.divisors(gbs // dp) if b & (b - 1) == 0 and b <= 16 and gbs // (dp * b) >= stage]
            schedules = _schedules(m.num_layers, stage)
            # under stages with FSDP: the stage's weights gathered per micro batch, or once per step (faster, for
            # the stage's unsharded weights and gradients in memory)
            onces = [False, True] if stage > 1 and fsdp > 1 else [False]
            for mbs, remat, fp8, (schedule, virtual), once in itertools.product(mbs_opts, remats, fp8s, schedules,
                                                                                  onces):
                c = copy.deepcopy(cfg)
                c.model.fp8 = fp8
                c.parallel.data, c.parallel.fsdp, c.parallel.tensor, c.parallel.stage = data, fsdp, tensor, stage
                c.parallel.pipeline_schedule, c.parallel.virtual_stages = schedule, virtual
                c.parallel.pipeline_fsdp_gather_once = once
                c.parallel.expert = expert
                c.parallel.context = context
                if context > 1:  # the flash kernels do not take context > 1: the ring attends in query tiles
                    c.parallel.context_impl, c.model.attention_impl = "ring", "xla"
                c.parallel.sequence_parallel = tensor > 1 and cfg.data.seq_len % tensor == 0
                c.train.micro_batch_size = mbs
                c.model.remat = remat
                out.append(c)
    return out


def passes_checks(cfg: Config, num_gpus: int) -> bool:
    """Whether a candidate passes config validation and the layout's checks (blockwise FP8's widths, ...)."""
    try:
        validate(cfg)
        preflight.check(cfg, Layout.planned(cfg, num_gpus))
    except (ConfigError, ValueError):
        return False
    return True


def to_compile(scored: list, max_compiles: int) -> list:
    """The candidates to compile: the closed form's best of each pipeline stage count first (the closed form
    cannot see what the step model counts in a schedule, so each stage count gets one compiled verdict), then
    the closed form's order; ``max_compiles`` in all."""
    best_per_stage: dict = {}
    for _, c in scored:
        best_per_stage.setdefault(c.parallel.stage, c)
    picked = list(best_per_stage.values())[:max_compiles]
    picked += [c for _, c in scored if all(c is not p for p in picked)][:max_compiles - len(picked)]
    return picked


def search(cfg: Config, gpu: GpuSpec, num_gpus: int, backend: str = "auto", devices=None, max_compiles: int = 12,
           top: int = 5, margin: float = 1.15, log=None, moe_gemm: str = "as_compiled",
           fp8_recipes: Optional[Sequence[str]] = None, latency_profiles: Optional[str] = None) -> dict:
    """Try layouts: closed-form memory prunes (estimate > ``margin`` x usable memory), a closed-form step time
    orders the rest, and ``max_compiles`` are compiled (:func:`to_compile`); those whose compiled peak does
    not fit are dropped, the others ranked by the step model's step time (:mod:`jaxtron.plan.steptime`).
    ``latency_profiles``: a directory; each of the ``top`` layouts is planned again with a latency profile of
    its own compile written there (:func:`jaxtron.plan.report.plan_with_latency_profile`, one more compile
    each) and takes that plan where it fits and predicts a shorter step (its overrides then name the profile);
    the ranking is redone."""
    check_moe_gemm(moe_gemm)
    t0 = time.perf_counter()
    if devices is None:
        devices, backend, notes = target_devices(gpu, num_gpus, backend)
    else:
        backend, notes = ("gpu" if devices[0].platform in ("gpu", "cuda") else "cpu"), []
    cands = [c for c in candidate_configs(cfg, num_gpus, gpu.gpus_per_node, fp8_recipes=fp8_recipes)
             if passes_checks(c, num_gpus)]
    scored, pruned, smallest = [], 0, None
    for c in cands:
        cc, _ = prepare_config(c, backend)
        layout = Layout.planned(cc, num_gpus)
        est = pm.closed_form_memory(cc, layout)
        if smallest is None or est["total"] < smallest[0]:
            smallest = (est["total"], c)
        if est["total"] > margin * gpu.usable_bytes:
            pruned += 1
            continue
        scored.append((pm.closed_form_step_s(cc, layout, gpu, num_gpus, moe_gemm), c))
    scored.sort(key=lambda x: x[0])
    results, rejected, later = [], [], {}
    compiling = to_compile(scored, max_compiles)
    for c in compiling:
        try:
            r = plan(c, gpu, num_gpus, backend, devices, keep_hlo=bool(latency_profiles), moe_gemm=moe_gemm)
        except Exception as err:  # noqa: BLE001 - a layout that does not compile is reported, not fatal
            rejected.append({"overrides": layout_overrides(c), "error": str(err).splitlines()[0][:300]})
            continue
        if log:
            log(f"  {r['overrides']}: peak {r['memory']['peak'] / 2**30:.1f} GiB, "
                f"step {r['step_model']['step_time_s']:.3f} s (step model), compile {r['compile_s']:.1f} s")
        if latency_profiles:  # the config and the compile's costs, for its replan with a profile below
            later[id(r)] = (c, r.pop("_latency_costs"))
            del r["_hlo"], r["_ops"]
        (results if r["memory"]["fits"] else rejected).append(r)
    results.sort(key=lambda r: r["step_model"]["step_time_s"])
    if latency_profiles:
        os.makedirs(latency_profiles, exist_ok=True)
        for i, r in enumerate(results[:top]):
            path = os.path.join(latency_profiles, f"layout{i + 1}.pbtxt")
            c, costs = later[id(r)]
            again = plan_with_latency_profile(c, r["step_model"], costs(), path, gpu, num_gpus, backend, devices,
                                              moe_gemm=moe_gemm)
            better = again["memory"]["fits"] and again["step_model"]["step_time_s"] < r["step_model"]["step_time_s"]
            if log:
                log(f"  {r['overrides']}: with a latency profile step {again['step_model']['step_time_s']:.3f} s"
                    + (", taken" if better else ", not taken"))
            if better:
                results[i] = again
            else:
                os.remove(path)
        results.sort(key=lambda r: r["step_model"]["step_time_s"])
    out = {"candidates": len(cands), "pruned_by_estimate": pruned, "compiled": len(compiling),
           "not_fitting_or_failed": [x if "error" in x else {"overrides": x["overrides"],
                                                             "peak": x["memory"]["peak"]} for x in rejected],
           "top": results[:top], "search_s": time.perf_counter() - t0,
           "notes": notes + ([PIPELINE_NOTE] if any(c.parallel.stage > 1 for c in compiling) else [])}
    if not results:
        if smallest is not None:
            out["smallest_estimate"] = {"overrides": layout_overrides(smallest[1]), "bytes": smallest[0]}
        out["nothing_fits"] = why_nothing_fits(out, cfg, gpu, num_gpus, margin)
    return out


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _gpus_for(num_gpus: int, need: float, usable: float) -> int:
    """A power-of-two multiple of ``num_gpus`` that would bring ``need`` (mostly sharded state) under ``usable``."""
    return num_gpus * 2 ** max(1, math.ceil(math.log2(max(need / usable, 1.0))))


def why_nothing_fits(out: dict, cfg: Config, gpu: GpuSpec, num_gpus: int, margin: float) -> list[str]:
    """Why --search found no layout, and what to change: lines for the user."""
    usable = gpu.usable_bytes
    lines = []
    if out["candidates"] == 0:
        return [f"no layout of {num_gpus} GPUs passes the config's checks (tensor sizes must divide the heads and "
                f"widths, the data-parallel size the global batch {cfg.train.global_batch_size}): try another "
                "--num-gpus or train.global_batch_size"]
    peaks = [x for x in out["not_fitting_or_failed"] if "peak" in x]
    gpus = num_gpus * 2
    if peaks:
        best = min(peaks, key=lambda x: x["peak"])
        lines.append(f"the smallest compiled peak is {_size(best['peak'])} per GPU against {_size(usable)} usable "
                     f"({best['overrides']})")
        gpus = _gpus_for(num_gpus, best["peak"], usable)
    if out["pruned_by_estimate"] == out["candidates"]:
        est = out.get("smallest_estimate")
        smallest = f" (the smallest, {_size(est['bytes'])}: {est['overrides']})" if est else ""
        lines.append(f"every layout's closed-form memory estimate is above {margin:g} x the {_size(usable)} usable "
                     f"per GPU{smallest}, so none was compiled")
        if est:
            gpus = _gpus_for(num_gpus, est["bytes"], usable)
    tried = "tensor, fsdp" + (", expert" if cfg.model.moe.num_experts else "") + " and pipeline sizes and " \
        "model.remat none/save_dots/full were all tried"
    lines.append(f"{tried}; try more GPUs (--num-gpus {gpus}: optimizer state and weights shard over them), a "
                 "smaller train.global_batch_size or data.seq_len, or a GPU with more memory (--gpu)")
    return lines
