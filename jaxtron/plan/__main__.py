"""python -m jaxtron.plan --config configs/llama3_70b.yaml --gpu h100 --num-gpus 64 [--search] [--json] [overrides]

Compiles the train step ahead of time for a cluster of GPUs (no GPU needed) and prints per device memory,
FLOPs, collective traffic and a roofline step time and MFU. See jaxtron/plan/report.py and model.py.

python -m jaxtron.plan --hlo FILE [--memory-json FILE] --gpu h100 --num-gpus N [--config X] [overrides]
judges an optimized XLA:GPU module compiled elsewhere (a peer's train step) by the same analysis, without
compiling; the config describes its model, batch, sequence and mesh (jaxtron/plan/hlo_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other error of the planner
        self.exit(2, f"error: {message} (python -m jaxtron.plan --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxtron.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset name or YAML path (default: tiny)")
    p.add_argument("--gpu", default="h100", help="h100, h200 or a100_80gb (default h100)")
    p.add_argument("--num-gpus", type=int, default=8)
    p.add_argument("--backend", choices=("auto", "gpu", "cpu"), default="auto",
                   help='compiler: XLA:GPU (auto, gpu; needs pip install -e ".[plan]") or cpu (the CPU compiler on '
                        'N virtual devices: memory figures indicative only)')
    p.add_argument("--search", action="store_true", help="try layouts and print the 5 fastest that fit")
    p.add_argument("--show-xla-warnings", action="store_true",
                   help="print XLA's '[SPMD] Involuntary full rematerialization' warnings (default: counted in one "
                        "note)")
    p.add_argument("--max-compiles", type=int, default=12, help="--search: compile at most this many layouts")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--search-fp8", nargs="+", default=None, choices=("none", "current", "delayed", "blockwise"),
                   metavar="RECIPE", help="--search: also try these model.fp8 recipes (FP8 changes the numerics, "
                                          "so by default every candidate keeps the config's)")
    p.add_argument("--search-latency-profiles", metavar="DIR",
                   help="--search: plan each of the top layouts again with a latency profile of its own compile "
                        "(written to DIR, one more compile each) and rank it by the faster of the two")
    p.add_argument("--latency-profile-out", metavar="FILE.pbtxt",
                   help="write the step model's costs of the compile to FILE as a latency profile for XLA:GPU's "
                        "scheduler, compile again with it (train.latency_profile=FILE) and report both; train "
                        "with train.latency_profile=FILE for that schedule")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--hlo", metavar="FILE", help="plan this optimized XLA:GPU module instead of compiling jaxtron's "
                                                 "train step (compiled.as_text(), .txt or .txt.gz; a peer's "
                                                 "program): the config and overrides describe its model, batch, "
                                                 "sequence and mesh")
    p.add_argument("--memory-json", metavar="FILE", help="--hlo: the compile's memory analysis (a JSON object of "
                                                         "argument/output/alias/temp_size_in_bytes), for its peak")
    p.add_argument("--moe-gemm", choices=("as_compiled", "grouped"), default="as_compiled",
                   help="MoE: the routed experts' matmuls in the roofline: as compiled (ragged_dot's masked dense "
                        "fallback, E x the FLOPs) or a grouped-GEMM kernel (active FLOPs; not built). The plan "
                        "prints both; this one ranks --search")
    hw = p.add_argument_group("roofline overrides (defaults per GPU in jaxtron/plan/gpus.py)")
    hw.add_argument("--peak-tflops", type=float, help="dense bf16")
    hw.add_argument("--fp8-peak-tflops", type=float, help="dense FP8 (the FP8 GEMMs of model.fp8)")
    hw.add_argument("--hbm-gbps", type=float)
    hw.add_argument("--nvlink-gbps", type=float, help="per GPU, one direction, inside a node")
    hw.add_argument("--net-gbps", type=float, help="per GPU, one direction, between nodes")
    hw.add_argument("--gpus-per-node", type=int)
    hw.add_argument("--compute-efficiency", type=float)
    hw.add_argument("--comm-efficiency", type=float)
    hw.add_argument("--collective-latency-us", type=float, help="launch overhead per collective on top of NCCL's "
                                                                 "latency model (default 0)")
    hw.add_argument("--mem-fraction", type=float, help="usable fraction of device memory (default 0.95)")
    sm = p.add_argument_group("step model overrides (defaults and sources in jaxtron/plan/gemm.py and steptime.py)")
    sm.add_argument("--gemm-peak-fraction", type=float, help="of the bf16 peak a large GEMM reaches (0.80)")
    sm.add_argument("--gemm-fp8-peak-fraction", type=float, help="of the FP8 peak a large FP8 GEMM reaches (0.70)")
    sm.add_argument("--hbm-fraction", type=float, help="of HBM bandwidth a streaming kernel reaches (0.90)")
    sm.add_argument("--attention-tflops", type=float, help="the attention kernel's forward+backward TFLOP/s "
                                                             "(causal half counted; default: measured per impl)")
    sm.add_argument("--gemm-table", help="a GEMM table measured by scripts/gemm_table.py: GEMMs at the measured "
                                         "efficiency of the nearest shape (default: jaxtron/plan/gemm_tables/<gpu>"
                                         ".json if committed, else the GEMM model)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. parallel.tensor=8")
    return p


def _gib(x: float) -> str:
    return f"{x / 2**30:8.2f} GiB"


def _print_memory(mem) -> None:
    print("\nmemory per device")
    if mem is None:
        print("  peak                unknown (no --memory-json: the module's text does not say it)")
        return
    if "params" in mem:  # jaxtron's own compile: the state's share is known
        print(f"  parameters          {_gib(mem['params'])}")
        print(f"  optimizer state     {_gib(mem['optimizer'])}")
        print(f"  gradients           {_gib(mem['grads'])}   (part of temp)")
        print(f"  activations + temp  {_gib(mem['activations_and_temp'])}   (temp {_gib(mem['temp']).strip()} "
              f"less gradients)")
    else:
        print(f"  arguments           {_gib(mem['arguments'])}   (outputs {_gib(mem['outputs']).strip()}, "
              f"{_gib(mem['aliased']).strip()} of them aliased to arguments)")
        print(f"  temp                {_gib(mem['temp'])}")
    print(f"  peak                {_gib(mem['peak'])}   ({mem['peak_from']})")
    verdict = "FITS" if mem["fits"] else "DOES NOT FIT"
    print(f"  usable              {_gib(mem['usable'])}   ({mem['mem_fraction']:.0%} of "
          f"{mem['device_memory'] / 2**30:.2f} GiB): {verdict}, "
          f"{'headroom' if mem['fits'] else 'short by'} {abs(mem['headroom']) / 2**30:.2f} GiB")


def _print_plan(r: dict) -> None:
    roof, fl = r["roofline"], r["flops"]
    compiled = (f"module {r['hlo_file']} ({r['compiler']})" if r.get("source") == "hlo"
                else f"compiler {r['compiler']} ({r['compile_s']:.1f} s)")
    print(f"{r['gpu_description']} x {r['num_gpus']} ({r['nodes']} node(s)), {compiled}")
    print(f"mesh {r['layout']}; global batch "
          f"{r['global_batch_size']} x seq {r['seq_len']}, micro batch {r['micro_batch_size']}, "
          f"{r['accumulation_steps']} accumulation step(s), remat={r['remat']}, attention={r['attention_impl']}")
    _print_memory(r["memory"])
    _print_params_and_moe(r)
    print("\nFLOPs per step (Megatron formula)")
    print(f"  model, full attention    {fl['model_flops_per_step']:.3e}  "
          f"({fl['model_flops_per_device']:.3e} per device)")
    print(f"  model, causal (s^2 / 2)  {fl['model_flops_per_step_causal']:.3e}")
    print(f"  executed per device      {fl['hardware_flops_per_device']:.3e}  (causal; x4/3 when model.remat=full)")
    print(f"  dots in the HLO          {fl['matmul_flops_per_device_hlo']:.3e} per device, "
          f"{fl['dot_over_model_flops']:.2f} x the model's (kernels' matmuls not among them)")
    print("\ncollectives per device per step (optimized HLO, loop bodies x trip count)")
    print(f"  {'kind':20s} {'ops':>5s} {'runs':>8s} {'result bytes':>14s} {'wire bytes':>14s} {'time':>9s}")
    for kind, c in r["collectives"].items():
        t = roof["comm_s_by_kind"].get(kind, 0.0)
        print(f"  {kind:20s} {c['ops']:5d} {c['executions']:8.0f} {c['result_bytes'] / 2**30:10.2f} GiB "
              f"{c['wire_bytes'] / 2**30:10.2f} GiB {t:8.3f}s")
    for kind, a in r.get("async_overlap", {}).items():
        print(f"  async {kind}: {a['pairs']} start/done pairs in the schedule, {a['exposed']} with no compute "
              "between them (exposed)")
    wb = roof["wire_bytes_by_link"]
    print(f"  over NVLink {wb['nvlink'] / 2**30:.2f} GiB, over the network {wb['network'] / 2**30:.2f} GiB")
    print("\nroofline prediction" + (f" (MoE experts: {roof['moe_gemm']})" if roof.get("moe_gemm") else ""))
    print(f"  compute {roof['compute_s']:.3f} s, HBM {roof['hbm_s']:.3f} s, exposed comm "
          f"{roof['exposed_comm_s']:.3f} s, overlappable comm {roof['overlappable_comm_s']:.3f} s")
    print(f"  step time {roof['step_time_s']:.3f} s, {roof['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
          f"MFU {roof['mfu']:.1%} (full attention FLOPs; {roof['mfu_causal']:.1%} causal)")
    h = r["hardware"]
    fp8 = f" (FP8 GEMMs {h['fp8_peak_tflops']:.0f})" if roof.get("fp8_flops_per_device") else ""
    print(f"  assumed: {h['peak_tflops']:.0f}{fp8} TFLOP/s x {h['compute_efficiency']}, HBM {h['hbm_gbps']:.0f} GB/s, "
          f"NVLink {h['nvlink_gbps']:.0f} GB/s, network {h['net_gbps']:.0f} GB/s per GPU x "
          f"{h['comm_efficiency']} (NCCL's ring/tree latency model, +{h['collective_latency_us']:.0f} us per launch)")
    sm = r.get("step_model")
    if sm:
        _print_step_model(sm)
    before = r.get("without_latency_profile")
    if before:
        print(f"  without the latency profile: step {_secs(before['step_time_s'])}, "
              f"{before['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, {_secs(before['exposed_comm_s'])} of "
              f"collectives exposed (train with train.latency_profile={r['latency_profile_file']} for the schedule "
              "above)")
    for n in r["notes"]:
        print(f"note: {n}")


def _secs(x: float) -> str:
    return f"{x:.3f} s" if x >= 0.1 else f"{x * 1e3:.3f} ms"


def _print_step_model(sm: dict) -> None:
    print("\nstep model (op by op from the optimized HLO; jaxtron/plan/steptime.py)")
    print(f"  GEMMs {_secs(sm['gemm_s'])} ({sm['gemm']['count']:.0f} runs at {sm['gemm_efficiency']:.1%} of the bf16 "
          f"peak), attention kernels {_secs(sm['attention_s'])}, memory-bound ops {_secs(sm['memory_bound_s'])} "
          f"({sm['memory_bound']['ops']:.0f} runs)")
    if sm["gemm"].get("batched_seconds"):
        print(f"    of the GEMMs, {_secs(sm['gemm']['batched_seconds'])} in GEMMs with batch dimensions (in a dense "
              "model, attention run as dots)")
    print(f"  collectives {_secs(sm['comm_s'])} on the wire: {_secs(sm['exposed_comm_s'])} exposed, "
          f"{_secs(sm['overlapped_comm_s'])} under compute (XLA's schedule replayed; jaxtron/plan/schedule.py)")
    for w in sm.get("longest_waits", [])[:3]:
        served = f"serves {w['op']}" if w["op"] else "unattributed: XLA's metadata names no op"
        print(f"    waits {_secs(w['seconds'])} per step on {w['collective']} {w['instruction']} ({served})")
    k = sm["kernels_per_step"]
    print(f"  kernels per step {k['total']:.0f}: {k['fusions']:.0f} fusions, {k['custom_calls']:.0f} custom calls, "
          f"{k['other']:.0f} other (collectives not counted)")
    print(f"  step time {_secs(sm['step_time_s'])}, {sm['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {sm['mfu']:.1%} "
          "(full attention FLOPs): a prediction")


def _count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _print_params_and_moe(r: dict) -> None:
    p, moe = r["params"], r["moe"]
    print(f"\nparameters {_count(p['total'])}"
          + (f" (every expert), {_count(p['active_per_token'])} active per token" if moe else ""))
    if not moe:
        return
    ef = moe["expert_matmul_flops_per_device"]
    print(f"MoE: {moe['moe_layers']} layers of {moe['experts']} experts, top-{moe['top_k']}, {moe['dispatch']}; "
          f"routed-expert matmul FLOPs per device per step: {ef['as_compiled_hlo']:.3e} as compiled (HLO), "
          f"{ef['grouped']:.3e} with a grouped GEMM")
    alt = moe["alternative"]
    print(f"  roofline below: {moe['gemm']}; with {alt['gemm']}: step {alt['step_time_s']:.3f} s, "
          f"{alt['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {alt['mfu']:.1%} (predicted)")
    ov = moe["all_to_all_overlapping_experts"]
    if ov["pairs"]:
        print(f"  async all-to-alls with expert matmuls scheduled between start and done: "
              f"{ov['with_expert_matmuls']} of {ov['pairs']} (the roofline counts them all as exposed)")


def _print_search(s: dict) -> None:
    print(f"search: {s['candidates']} layouts, {s['pruned_by_estimate']} pruned by the closed-form memory "
          f"estimate, {s['compiled']} compiled, {len(s['not_fitting_or_failed'])} did not fit or failed "
          f"({s['search_s']:.0f} s)")
    for x in s["not_fitting_or_failed"]:
        why = x.get("error") or f"peak {x['peak'] / 2**30:.1f} GiB"
        print(f"  dropped: {x['overrides']}  ({why})")
    if s.get("nothing_fits"):
        print("\nnothing fits:")
        for line in s["nothing_fits"]:
            print(f"  {line}")
    else:
        print(f"\ntop {len(s['top'])} by the step model's predicted step time (all fit):")
    for i, r in enumerate(s["top"], 1):
        sm, roof, mem = r["step_model"], r["roofline"], r["memory"]
        print(f"{i}. step {sm['step_time_s']:.3f} s  {sm['tokens_per_s_per_gpu']:.0f} tokens/s/GPU  MFU {sm['mfu']:.1%}  "
              f"(roofline {roof['step_time_s']:.3f} s)  peak {mem['peak'] / 2**30:.1f} GiB / "
              f"{mem['usable'] / 2**30:.1f} GiB  ({r['compiler']})")
        print(f"   {r['overrides']}")
        before = r.get("without_latency_profile")
        if before:
            print(f"   (with its latency profile; without: step {before['step_time_s']:.3f} s, "
                  f"{before['tokens_per_s_per_gpu']:.0f} tokens/s/GPU)")
    for n in s["notes"]:
        print(f"note: {n}")


XLA_WARNINGS = (b"[SPMD] Involuntary full rematerialization",)


def _xla_warnings_note(dropped: dict) -> str | None:
    n = sum(dropped.values())
    if not n:
        return None
    return (f"XLA warned {n} times of '[SPMD] Involuntary full rematerialization' while compiling (a resharding "
            "it does by gathering the whole tensor; the compiled memory and collectives above include it); "
            "--show-xla-warnings prints them")


def _bad_argument(args) -> str | None:
    """The first out-of-range argument, as a message (None: all fine)."""
    for name in ("num_gpus", "max_compiles", "top", "gpus_per_node"):
        v = getattr(args, name)
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')}: must be >= 1, got {v}"
    for name in ("peak_tflops", "fp8_peak_tflops", "hbm_gbps", "nvlink_gbps", "net_gbps", "attention_tflops"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            return f"--{name.replace('_', '-')}: must be > 0, got {v}"
    if args.collective_latency_us is not None and not args.collective_latency_us >= 0:
        return f"--collective-latency-us: must be >= 0, got {args.collective_latency_us}"
    for name in ("compute_efficiency", "comm_efficiency", "mem_fraction", "gemm_peak_fraction",
                 "gemm_fp8_peak_fraction", "hbm_fraction"):
        v = getattr(args, name)
        if v is not None and not 0 < v <= 1:
            return f"--{name.replace('_', '-')}: must be in (0, 1], got {v}"
    if args.latency_profile_out and (args.search or args.hlo):
        other = "--search" if args.search else "--hlo"
        return f"--latency-profile-out writes the profile of one compile: not with {other}"
    if args.search_latency_profiles and not args.search:
        return "--search-latency-profiles goes with --search"
    if args.latency_profile_out and not args.latency_profile_out.endswith(".pbtxt"):
        return (f"--latency-profile-out {args.latency_profile_out}: must end in .pbtxt (XLA reads a text profile "
                "by that suffix)")
    if args.memory_json and not args.hlo:
        return "--memory-json goes with --hlo (a compile gives its own memory analysis)"
    if args.hlo and (args.search or args.backend != "auto"):
        return f"--hlo reads a module compiled elsewhere: {'--search' if args.search else '--backend'} does not apply"
    return None


def _gpu(args):
    """The GPU with the command line's overrides; a bad --gemm-table is a one-line error before any work."""
    from jaxtron.plan.gpus import get_gpu

    gpu = get_gpu(args.gpu).replace(
        peak_tflops=args.peak_tflops, fp8_peak_tflops=args.fp8_peak_tflops, hbm_gbps=args.hbm_gbps,
        nvlink_gbps=args.nvlink_gbps,
        net_gbps=args.net_gbps, gpus_per_node=args.gpus_per_node, compute_efficiency=args.compute_efficiency,
        comm_efficiency=args.comm_efficiency, collective_latency_us=args.collective_latency_us,
        mem_fraction=args.mem_fraction, gemm_peak_fraction=args.gemm_peak_fraction,
        gemm_fp8_peak_fraction=args.gemm_fp8_peak_fraction, hbm_fraction=args.hbm_fraction,
        attention_tflops=args.attention_tflops, gemm_table=args.gemm_table)
    if args.gemm_table:
        from jaxtron.plan.gemm import load_table
        load_table(args.gemm_table)
    return gpu


def _main_hlo(args) -> int:
    """--hlo: the report on a module compiled elsewhere; nothing is compiled, the CUDA plugin is not needed."""
    from jaxtron import config as config_lib
    from jaxtron import preflight
    from jaxtron.plan.hlo_report import plan_hlo_file

    try:
        cfg = config_lib.load(args.config, args.overrides)
        preflight.check(cfg)
        out = plan_hlo_file(cfg, _gpu(args), args.num_gpus, args.hlo, args.memory_json, args.moe_gemm)
    except (config_lib.ConfigError, ValueError, RuntimeError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a module the analysis cannot read is the file's error, one line
        print(f"error: --hlo {args.hlo}: the analysis could not read this module ({type(err).__name__}: "
              f"{str(err).splitlines()[0][:200] if str(err) else ''})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, default=float))
    else:
        _print_plan(out)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_intermixed_args(argv)  # overrides on both sides of the options
    bad = _bad_argument(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if args.hlo:
        return _main_hlo(args)
    # Before jax is imported: let the CUDA plugin load without CUDA libraries (XLA:GPU cross-compile), and give
    # --backend cpu as many virtual devices as GPUs.
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    flags = os.environ.get("XLA_FLAGS", "")
    if args.backend == "cpu" and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.num_gpus}".strip()
    # A caller's JAX_PLATFORMS=cpu is fine: the XLA:GPU compile uses a topology description, not a GPU client.
    import jax

    if args.backend == "cpu":
        try:
            jax.config.update("jax_num_cpu_devices", args.num_gpus)
        except RuntimeError:  # already initialized (called from Python): target_devices says what is missing
            pass
    from jaxtron import config as config_lib
    from jaxtron import preflight
    from jaxtron.jax_startup import stderr_filtered
    from jaxtron.plan import plan, search

    try:
        cfg = config_lib.load(args.config, args.overrides)
        preflight.check(cfg)
        gpu = _gpu(args)
        with stderr_filtered(() if args.show_xla_warnings else XLA_WARNINGS) as err_out:
            if args.search:
                log = None if args.json else err_out.say  # progress at once, past the filter
                out = search(cfg, gpu, args.num_gpus, args.backend, max_compiles=args.max_compiles, top=args.top,
                             log=log, moe_gemm=args.moe_gemm, fp8_recipes=args.search_fp8,
                             latency_profiles=args.search_latency_profiles)
            else:
                out = plan(cfg, gpu, args.num_gpus, args.backend, moe_gemm=args.moe_gemm,
                           latency_profile_out=args.latency_profile_out)
        note = _xla_warnings_note(err_out.dropped)
        if note:
            out["notes"] = out["notes"] + [note]
        if args.search:
            print(json.dumps(out, default=float) if args.json else "", end="\n" if args.json else "")
            if not args.json:
                _print_search(out)
        else:
            if args.json:
                print(json.dumps(out, default=float))
            else:
                _print_plan(out)
    except (config_lib.ConfigError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
