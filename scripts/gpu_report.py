"""One command for a machine with one GPU: kernel checks, kernel benchmarks, training steps and the planner's
predictions for the same steps, written as one JSON and one markdown table.

    python scripts/gpu_report.py --out runs/gpu_report            # 8 minutes; again to go on (about 20 in all)
    python scripts/gpu_report.py --out runs/gpu_report --budget 300
    python scripts/gpu_report.py --out /tmp/r --tiny               # the tiny model: the CPU path, in a minute

A GPU is lent in short slots (minutes, start-up included), so the report runs in calls: each call has a time
budget (``--budget`` seconds, default 480), runs the parts still to do in order of value, writes report.json
and report.md as each part ends, and stops when the budget is spent; the next call with the same ``--out``
continues where the last stopped (``--fresh`` starts over). A part cut short by the budget runs again next
call; one that failed or hit its own ``--timeout`` is recorded and not retried. Order of value: the training
steps beside the planner's predictions (4, 5; after the first model's bf16 pair, that step again with
``train.uninitialized_scan_outputs=false``: the default's losses and gain on a GPU), the kernels never timed
on a GPU (2, 3: Mosaic attention, grouped matmul, the FP8 GEMMs), the GEMM table, the kernel check (1).

Parts, each a subprocess with its own time limit (a part that fails or times out is recorded, and the rest
still run):

1. ``kernel-check`` (GPU): ``scripts/bench_kernels.py --check``: every kernel's outputs and gradients
   against its reference on the GPU.
2. ``attention`` (GPU): flash attention (Triton, Mosaic) against cuDNN and XLA at seq 4096 and 8192, plain
   and packed (``bench_kernels.py``; causal FLOPs, see its docstring).
3. ``grouped-matmul`` (GPU): the MoE grouped matmul against ``ragged_dot`` (``bench_kernels.py --gmm``);
   ``fp8-gemm`` (GPU): Llama-3-8B's projection GEMMs in bf16 and each FP8 recipe (``--fp8``);
   ``gemm-table`` (GPU; ``--tiny``: its small-shape CPU path): ``scripts/gemm_table.py``, bf16 and FP8 GEMMs
   of the Llama projections' shapes, written as ``gemm_table.json``: the planner's measured GEMM table.
4. ``train/<model>/<fp8>``: ``scripts/bench_train.py`` on one device for a Llama-3.2-1B-shaped model and a
   Llama-3-8B-shaped model with 4 layers (seq 4096), in bf16 and each ``model.fp8`` recipe: tokens/s, MFU
   (full and causal attention FLOPs, against the bf16 peak), compiled and device memory. On CPU (``--tiny``)
   the tiny default model runs instead, for 2 steps.
5. ``plan/<model>/<fp8>``: ``python -m jaxtron.plan`` for the same run on one GPU of the same kind (an
   XLA:GPU ahead-of-time compile: a prediction, its step model with the GEMM table just measured), beside the
   measurement. Needs the CUDA compiler plugin.

GPU parts on a machine without a GPU are recorded as skipped with the reason. ``report.json`` holds every
part's command, status, seconds and parsed output; ``report.md`` the tables. Put its figures in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = ("none", "current", "delayed", "blockwise")
# one GPU: no parallelism, bf16, cuDNN attention (the configs' default, xla, materializes the scores)
MODELS = {
    "llama3.2-1b": ["model.vocab_size=128256", "model.hidden_size=2048", "model.num_layers=16",
                    "model.num_heads=32", "model.num_kv_heads=8", "model.intermediate_size=8192",
                    "model.tie_embeddings=true", "model.rope_theta=500000", "data.seq_len=4096",
                    "train.global_batch_size=4", "model.remat=save_dots"],
    "llama3-8b-4layers": ["--config", "llama3_8b", "model.num_layers=4", "data.seq_len=4096",
                          "train.global_batch_size=2", "model.remat=save_dots"],
}
ONE_GPU = ["parallel.data=1", "parallel.fsdp=1", "parallel.tensor=1", "model.dtype=bfloat16",
           "train.micro_batch_size=null", "model.attention_impl=cudnn"]
TINY = {"tiny": []}
ZEROED = "scan-outputs-zero-filled"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for report.json and report.md")
    p.add_argument("--tiny", action="store_true", help="the tiny default model, 2 steps (the CPU path)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--attention-impls", nargs="+", default=["pallas", "mosaic", "cudnn", "xla"])
    p.add_argument("--timeout", type=int, default=600, help="seconds per part")
    p.add_argument("--budget", type=float, default=480,
                   help="seconds for this call; parts left over run on the next call with the same --out")
    p.add_argument("--fresh", action="store_true", help="start over instead of continuing --out's report")
    return p.parse_args(argv)


def _platform() -> tuple[str, str]:
    from jaxtron.jax_startup import import_jax

    jax = import_jax()
    d = jax.devices()[0]
    return d.platform, d.device_kind


def _gpu_name(kind: str) -> str | None:
    k = kind.lower()
    return "h200" if "h200" in k else "h100" if "h100" in k else "a100_80gb" if "a100" in k else None


def run_part(name: str, argv: list[str], timeout: float) -> dict:
    """Run one part; its result is the JSON object it printed last."""
    t0 = time.perf_counter()
    part = {"part": name, "command": " ".join(argv)}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**part, "status": "timeout", "seconds": round(time.perf_counter() - t0, 1)}
    part["seconds"] = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**part, "status": "failed", "rc": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    return {**part, "status": "ok", "result": json.loads(lines[-1])}


def skipped(name: str, why: str) -> dict:
    return {"part": name, "status": "skipped", "reason": why}


def planned(args, platform: str, kind: str) -> list[tuple[str, object]]:
    """Every part in order of value: (name, plan), where plan(done) gives the part's argv, or a dict (the part's
    record) when it does not run here; ``done`` is the parts recorded so far, this call's and earlier calls'."""
    py = sys.executable
    no_gpu = f"needs a GPU (this machine's JAX platform is {platform})"
    table = os.path.join(args.out, "gemm_table.json")

    def gpu_only(name, argv):
        return lambda done: argv if platform == "gpu" else skipped(name, no_gpu)

    def measured_table(done):  # a table measured on this GPU by an earlier call; a CPU's says nothing of a GPU's
        ok = done.get("gemm-table", {}).get("status") == "ok"
        return ["--gemm-table", table] if platform == "gpu" and ok and os.path.exists(table) else []

    out = []
    models = TINY if args.tiny else MODELS
    steps = ["--steps", "2", "--warmup", "0"] if args.tiny else ["--steps", "10", "--warmup", "2"]
    gpu = _gpu_name(kind) or "h100"
    # bf16 rows of every model first, then each FP8 recipe
    for fp8 in args.precisions:
        for model, overrides in models.items():
            run = overrides + ([] if args.tiny else ONE_GPU) + [f"model.fp8={fp8}"]
            out.append((f"train/{model}/{fp8}",
                        lambda done, run=run: [py, "scripts/bench_train.py", "--json", *steps, *run]))
            out.append((f"plan/{model}/{fp8}",
                        lambda done, run=run: [py, "-m", "jaxtron.plan", "--json", "--gpu", gpu, "--num-gpus", "1",
                                               *measured_table(done), *run]))
    if "none" in args.precisions:
        # train.uninitialized_scan_outputs (on by default for GPU compiles) checked on the GPU: the first model's
        # bf16 step again with the scan's outputs zero-filled, for the same losses and the step time it saves
        model, overrides = next(iter(models.items()))
        zeroed = (overrides + ([] if args.tiny else ONE_GPU)
                  + ["model.fp8=none", "train.uninitialized_scan_outputs=false"])
        out.insert(2, (ZEROED, gpu_only(ZEROED, [py, "scripts/bench_train.py", "--json", *steps, *zeroed])))
    kernels = [py, "scripts/bench_kernels.py", "--json"]
    out.append(("attention", gpu_only("attention", kernels + ["--seq", "4096", "8192", "--packed", "--attention-only",
                                                              "--impls", *args.attention_impls])))
    out.append(("grouped-matmul", gpu_only("grouped-matmul", kernels + ["--gmm"])))
    out.append(("fp8-gemm", gpu_only("fp8-gemm", kernels + ["--fp8"])))
    # measured on a GPU, the planner's GEMM table (for the plan parts of later calls); --tiny on CPU runs the
    # script's small-shape path
    gemm = [py, "scripts/gemm_table.py", "--out", table] + (["--tiny"] if args.tiny else [])
    out.append(("gemm-table", lambda done: gemm if platform == "gpu" or args.tiny else skipped("gemm-table", no_gpu)))
    out.append(("kernel-check", gpu_only("kernel-check", kernels + ["--check", "--seq", "2048"])))
    return out


def run_parts(args, report: dict, write) -> list[str]:
    """Run the parts not yet done within ``--budget`` seconds, recording each as it ends; returns the names left."""
    t0 = time.perf_counter()
    call = len(report["calls"])
    done = {p["part"]: p for p in report["parts"]}
    left = []
    parts = planned(args, report["environment"]["platform"], report["environment"]["device_kind"])
    order = {name: i for i, (name, _) in enumerate(parts)}
    for name, plan in parts:
        if name in done and not done[name].get("cut_by_budget"):
            continue
        argv = plan(done)
        remaining = args.budget - (time.perf_counter() - t0)
        if isinstance(argv, dict):
            part = argv
        elif remaining <= 0:
            left.append(name)
            continue
        else:
            part = run_part(name, argv, min(args.timeout, remaining))
            if part["status"] == "timeout" and remaining < args.timeout:
                part["cut_by_budget"] = True
                left.append(name)
            if name.startswith("plan/") and part["status"] == "failed" and "plugin" in part.get("stderr_tail", ""):
                part = skipped(name, _note(part))  # no XLA:GPU compiler on this machine
        part["call"] = call
        done[name] = part
        report["parts"] = sorted([p for p in report["parts"] if p["part"] != name] + [part],
                                 key=lambda p: order.get(p["part"], len(order)))
        write(report)
    return left


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return lines


def _note(part: dict) -> str:
    """Why a part was skipped, or the last line of a failed part's stderr."""
    tail = (part.get("stderr_tail") or "").strip().splitlines()
    return part.get("reason") or (tail[-1][:160].replace("|", "/") if tail else "")


def markdown(report: dict) -> str:
    env = report["environment"]
    md = [f"# GPU report: {env['device_kind']} ({env['platform']})", "",
          f"jax {env['jax']}, {env['date']}; `python scripts/gpu_report.py {' '.join(env['argv'])}`; the planner "
          f"predicts one {env['planner_gpu']}; {len(report['calls'])} call(s) with budgets of "
          f"{', '.join(str(round(c['budget_s'])) for c in report['calls'])} s.", "",
          "## Parts", ""]
    md += _table([{"part": p["part"], "status": "cut by the budget" if p.get("cut_by_budget") else p["status"],
                   "call": p.get("call"), "seconds": p.get("seconds"), "note": _note(p)}
                  for p in report["parts"]], ["part", "status", "call", "seconds", "note"])
    by = {p["part"]: p for p in report["parts"]}
    for name in ("kernel-check", "attention", "grouped-matmul", "fp8-gemm"):
        rows = (by[name].get("result") or {}).get("rows") if name in by else None
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            md += ["", f"## {name}", ""] + _table(rows, cols)
    zeroed = (by.get(ZEROED) or {}).get("result")
    first = next((p.get("result") for p in report["parts"] if p["part"].startswith("train/")
                  and p["part"].endswith("/none")), None)
    if zeroed and first:
        md += ["", "## train.uninitialized_scan_outputs (the first model's bf16 step, on and off)", ""]
        md += _table([{"scan outputs": label, "tokens/s/GPU": r.get("tokens_per_s_per_device"),
                       "final loss": r.get("final_loss")} for label, r in (("uninitialized (default)", first),
                                                                           ("zero-filled", zeroed))],
                     ["scan outputs", "tokens/s/GPU", "final loss"])
    train = []
    for p in report["parts"]:
        if not p["part"].startswith("train/"):
            continue
        _, model, fp8 = p["part"].split("/")
        r = p.get("result") or {}
        planned = by.get(f"plan/{model}/{fp8}", {}).get("result") or {}
        plan, roof = planned.get("step_model") or {}, planned.get("roofline") or {}
        measured, predicted = r.get("tokens_per_s_per_device"), plan.get("tokens_per_s_per_gpu")
        train.append({"model": model, "fp8": fp8, "status": p["status"], "tokens/s/GPU": measured,
                      "MFU full": r.get("mfu_full"), "MFU causal": r.get("mfu_causal"),
                      "compiled temp GiB": (r.get("compiled_temp_bytes") or 0) / 2**30 or None,
                      "device peak GiB": r.get("device_peak_gib"), "planner tokens/s/GPU": predicted,
                      "planner MFU": plan.get("mfu"), "roofline tokens/s/GPU": roof.get("tokens_per_s_per_gpu"),
                      "measured / predicted": measured / predicted if measured and predicted else None})
    if train:
        md += ["", "## Training steps (one GPU; MFU against the bf16 peak, attention FLOPs counted whole "
                   "(full) and halved (causal); the planner's figures are predictions)", ""]
        md += _table(train, list(train[0]))
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    platform, kind = _platform()
    import jax

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "report.json")
    environment = {"platform": platform, "device_kind": kind, "jax": jax.__version__,
                   "argv": sys.argv[1:] if argv is None else list(argv), "planner_gpu": _gpu_name(kind) or "h100"}
    report = {"environment": environment, "calls": [], "parts": []}
    if os.path.exists(path) and not args.fresh:
        try:
            with open(path) as f:
                report = json.load(f)
            earlier = report["environment"]
            if not isinstance(report["calls"], list) or not isinstance(report["parts"], list):
                raise ValueError("no calls and parts lists")
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"gpu_report: {path} is not a report to continue ({err}); pass --fresh to start over",
                  file=sys.stderr)
            return 2
        if (earlier["platform"], earlier["device_kind"], earlier["jax"]) != (platform, kind, jax.__version__):
            print(f"gpu_report: {path} was measured on {earlier['device_kind']} with jax {earlier['jax']}, this is "
                  f"{kind} with jax {jax.__version__}; pass --fresh to start over", file=sys.stderr)
            return 2
    report["calls"].append({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "budget_s": args.budget,
                            "argv": environment["argv"]})
    report["environment"]["date"] = report["calls"][0]["date"]

    def write(rep):
        for name, text in (("report.json", json.dumps(rep, indent=1)), ("report.md", markdown(rep))):
            tmp = os.path.join(args.out, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(args.out, name))

    left = run_parts(args, report, write)
    write(report)
    bad = [p["part"] for p in report["parts"] if p["status"] in ("failed", "timeout") and not p.get("cut_by_budget")]
    finished = sum(not p.get("cut_by_budget") for p in report["parts"])
    print(f"wrote {args.out}/report.json and report.md; {finished} parts done"
          + (f", failed: {', '.join(bad)}" if bad else "")
          + (f"; budget spent, {len(left)} left (call again with the same --out): {', '.join(left)}" if left else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
