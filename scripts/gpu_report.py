"""One command for a machine with one GPU: kernel checks, kernel benchmarks, training steps and the planner's
predictions for the same steps, written as one JSON and one markdown table.

    python scripts/gpu_report.py --out runs/gpu_report            # about 20 minutes on one H100
    python scripts/gpu_report.py --out /tmp/r --tiny               # the tiny model: the CPU path, in a minute

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
# one GPU: no parallelism, bf16, the attention kernel the trainer would pick on Hopper
MODELS = {
    "llama3.2-1b": ["model.vocab_size=128256", "model.hidden_size=2048", "model.num_layers=16",
                    "model.num_heads=32", "model.num_kv_heads=8", "model.intermediate_size=8192",
                    "model.tie_embeddings=true", "model.rope_theta=500000", "data.seq_len=4096",
                    "train.global_batch_size=4", "model.remat=save_dots"],
    "llama3-8b-4layers": ["--config", "llama3_8b", "model.num_layers=4", "data.seq_len=4096",
                          "train.global_batch_size=2", "model.remat=save_dots"],
}
ONE_GPU = ["parallel.data=1", "parallel.fsdp=1", "parallel.tensor=1", "model.dtype=bfloat16",
           "train.micro_batch_size=null"]
TINY = {"tiny": []}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for report.json and report.md")
    p.add_argument("--tiny", action="store_true", help="the tiny default model, 2 steps (the CPU path)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--attention-impls", nargs="+", default=["pallas", "mosaic", "cudnn", "xla"])
    p.add_argument("--timeout", type=int, default=600, help="seconds per part")
    return p.parse_args(argv)


def _platform() -> tuple[str, str]:
    from jaxtron.jax_startup import import_jax

    jax = import_jax()
    d = jax.devices()[0]
    return d.platform, d.device_kind


def _gpu_name(kind: str) -> str | None:
    k = kind.lower()
    return "h200" if "h200" in k else "h100" if "h100" in k else "a100_80gb" if "a100" in k else None


def run_part(name: str, argv: list[str], timeout: int, env: dict | None = None) -> dict:
    """Run one part; its result is the JSON object(s) it printed (last line, or every line for kernel rows)."""
    t0 = time.perf_counter()
    part = {"part": name, "command": " ".join(argv)}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {**part, "status": "timeout", "seconds": round(time.perf_counter() - t0, 1)}
    part["seconds"] = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**part, "status": "failed", "rc": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    return {**part, "status": "ok", "result": json.loads(lines[-1])}


def skipped(name: str, why: str) -> dict:
    return {"part": name, "status": "skipped", "reason": why}


def parts(args, platform: str, kind: str) -> list[dict]:
    py = sys.executable
    out = []
    no_gpu = f"needs a GPU (this machine's JAX platform is {platform})"
    kernels = [py, "scripts/bench_kernels.py", "--json"]
    gpu_parts = [("kernel-check", kernels + ["--check", "--seq", "2048"]),
                 ("attention", kernels + ["--seq", "4096", "8192", "--packed", "--attention-only",
                                          "--impls", *args.attention_impls]),
                 ("grouped-matmul", kernels + ["--gmm"]),
                 ("fp8-gemm", kernels + ["--fp8"])]
    for name, argv in gpu_parts:
        out.append(run_part(name, argv, args.timeout) if platform == "gpu" else skipped(name, no_gpu))
    # the GEMM table: measured on a GPU and handed to the planner parts below; --tiny on CPU runs the script's
    # small-shape path (a CPU's GEMMs say nothing of a GPU's, so the planner does not take that table)
    table = os.path.join(args.out, "gemm_table.json")
    gemm = [py, "scripts/gemm_table.py", "--out", table] + (["--tiny"] if args.tiny else [])
    out.append(run_part("gemm-table", gemm, args.timeout) if platform == "gpu" or args.tiny
               else skipped("gemm-table", no_gpu))
    measured = ["--gemm-table", table] if platform == "gpu" and out[-1]["status"] == "ok" else []
    models = TINY if args.tiny else MODELS
    steps = ["--steps", "2", "--warmup", "0"] if args.tiny else ["--steps", "10", "--warmup", "2"]
    gpu = _gpu_name(kind) or "h100"
    for model, overrides in models.items():
        one = [] if args.tiny else ONE_GPU
        for fp8 in args.precisions:
            run = overrides + one + [f"model.fp8={fp8}"]
            out.append(run_part(f"train/{model}/{fp8}", [py, "scripts/bench_train.py", "--json", *steps, *run],
                                args.timeout))
            plan = run_part(f"plan/{model}/{fp8}", [py, "-m", "jaxtron.plan", "--json", "--gpu", gpu,
                                                    "--num-gpus", "1", *measured, *run], args.timeout)
            if plan["status"] == "failed" and "plugin" in plan.get("stderr_tail", ""):  # no XLA:GPU compiler
                plan = skipped(plan["part"], _note(plan))
            out.append(plan)
    return out


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
          f"predicts one {env['planner_gpu']}.", "",
          "## Parts", ""]
    md += _table([{"part": p["part"], "status": p["status"], "seconds": p.get("seconds"), "note": _note(p)}
                  for p in report["parts"]], ["part", "status", "seconds", "note"])
    by = {p["part"]: p for p in report["parts"]}
    for name in ("kernel-check", "attention", "grouped-matmul", "fp8-gemm"):
        rows = (by[name].get("result") or {}).get("rows") if name in by else None
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            md += ["", f"## {name}", ""] + _table(rows, cols)
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
    report = {"environment": {"platform": platform, "device_kind": kind, "jax": jax.__version__,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "argv": sys.argv[1:] if argv is None else list(argv),
                              "planner_gpu": _gpu_name(kind) or "h100"},
              "parts": parts(args, platform, kind)}
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown(report))
    bad = [p["part"] for p in report["parts"] if p["status"] in ("failed", "timeout")]
    print(f"wrote {args.out}/report.json and report.md; {len(report['parts'])} parts"
          + (f", failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
