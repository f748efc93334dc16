"""The planner's predictions beside measured training throughput: the validation table of docs/planner.md.

    python scripts/planner_validation.py --out runs/planner_validation      # every row (about 15 min on 2 cores)
    python scripts/planner_validation.py --out /tmp/v --rows jaxtron-8l-save_dots

Each row compiles one training step with ``python -m jaxtron.plan --json`` (XLA:GPU, no GPU needed) for the
layout closest to the measured run that jaxtron can express, and sets two predictions beside the measured
tokens/s/GPU: the op-by-op step model (``step_model``, jaxtron/plan/steptime.py) and the roofline with its fixed
``compute_efficiency`` (``roofline``). The error is (predicted - measured) / measured. Nothing is fitted to this
table: the step model's constants are set in jaxtron/plan/gemm.py and steptime.py, each with its source.
Writes ``table.md`` and ``rows.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PP4 = ["parallel.tensor=4", "parallel.stage=4", "parallel.fsdp=4", "parallel.data=1", "parallel.pipeline_fsdp_gather_once=true", "model.remat=none"]
PP8V5 = ["parallel.tensor=4", "parallel.stage=8", "parallel.fsdp=2", "parallel.data=1", "parallel.pipeline_fsdp_gather_once=true",
         "parallel.pipeline_schedule=circular", "parallel.virtual_stages=5", "model.remat=none"]
SAVE_DOTS = ["model.remat=save_dots", "train.micro_batch_size=1"]
LLAMA2_70B = ["model.vocab_size=32000", "model.rope_theta=10000.0", "data.seq_len=4096"]
ONE_H100_8L = ["model.num_layers=8", "parallel.fsdp=1", "parallel.data=1", "train.global_batch_size=2",
               "train.micro_batch_size=1", "data.seq_len=8192", "model.attention_impl=cudnn"]

# name, measured tokens/s/GPU, who measured it, layout note, plan arguments
ROWS = [
    ("jaxtron-8l-save_dots", 27150, "jaxtron, 1 H100 (docs/performance.md)", "Llama-3-8B width, 8 layers, seq 8192, "
     "save_dots", ["--config", "llama3_8b", "--num-gpus", "1", *ONE_H100_8L, "model.remat=save_dots"]),
    ("jaxtron-8l-full", 22535, "jaxtron, 1 H100 (docs/performance.md)", "the same, remat full",
     ["--config", "llama3_8b", "--num-gpus", "1", *ONE_H100_8L, "model.remat=full"]),
    ("nemo-llama3-8b-bf16", 10682, "NeMo, 8 H100, bf16", "Llama-3-8B, fsdp 8, save_dots, mbs 1 (NeMo: TP1 PP1 "
     "CP2, no full recompute)", ["--config", "llama3_8b", "--num-gpus", "8", *SAVE_DOTS]),
    ("bridge-llama3-8b-fp8", 14451, "Megatron-Bridge, 8 H100, FP8, FSDP 8", "Llama-3-8B, fsdp 8, save_dots, mbs 1, "
     "model.fp8=current", ["--config", "llama3_8b", "--num-gpus", "8", *SAVE_DOTS, "model.fp8=current"]),
    ("maxtext-llama2-70b", 1170, "MaxText, 64 H100, bf16, FSDP 64", "Llama-2-70B shape, fsdp 64, remat full, mbs 1",
     ["--config", "llama3_70b", "--num-gpus", "64", *LLAMA2_70B, "parallel.fsdp=64", "parallel.tensor=1",
      "parallel.sequence_parallel=false"]),
    ("nemo-llama3-70b-bf16", 1121, "NeMo, 64 H100, bf16 (pipeline stages)", "Llama-3-70B, tensor 4 x stage 4 (1f1b) x "
     "fsdp 4 (SP), stage weights gathered once, remat none", ["--config", "llama3_70b", "--num-gpus", "64", *PP4]),
    ("bridge-llama3-70b-fp8", 1664, "Megatron-Bridge, 64 H100, FP8, TP4 PP8 VP5", "Llama-3-70B, tensor 4 x stage 8 x "
     "virtual 5 (circular) x fsdp 2 (SP), model.fp8=current, stage weights gathered once, remat none",
     ["--config", "llama3_70b", "--num-gpus", "64", *PP8V5, "model.fp8=current"]),
    ("bridge-qwen3-30b-a3b-fp8", 8960, "Megatron-Bridge, 16 H100, FP8, EP 16", "Qwen3-30B-A3B, expert 16, capacity "
     "1.25, model.fp8=current, remat full, the Pallas grouped matmul (bf16)",
     ["--config", "qwen3_30b_a3b", "--num-gpus", "16", "parallel.expert=16", "parallel.fsdp=1", "parallel.data=1",
      "model.moe.ep_capacity_factor=1.25", "model.fp8=current", "model.moe.gmm_impl=pallas"]),
]


def plan(args: list[str]) -> dict:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "--xla_backend_optimization_level=0"))
    proc = subprocess.run([sys.executable, "-m", "jaxtron.plan", "--json", "--gpu", "h100", *args],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout)


def row(name, measured, who, layout, args) -> dict:
    r = plan(args)
    out = {"name": name, "measured": measured, "measured_by": who, "layout": layout,
           "command": "python -m jaxtron.plan --gpu h100 " + " ".join(args)}
    if "error" in r:
        return {**out, "error": r["error"]}
    sm, roof = r["step_model"], r["roofline"]
    return {**out, "fits": r["memory"]["fits"], "peak_gib": r["memory"]["peak"] / 2**30,
            "step_model": sm["tokens_per_s_per_gpu"], "roofline": roof["tokens_per_s_per_gpu"],
            "step_model_error": sm["tokens_per_s_per_gpu"] / measured - 1,
            "roofline_error": roof["tokens_per_s_per_gpu"] / measured - 1,
            "parts_s": {k: sm[k] for k in ("gemm_s", "attention_s", "memory_bound_s", "comm_s", "exposed_comm_s")},
            "longest_waits": sm["longest_waits"][:3],
            "gemm_efficiency": sm["gemm_efficiency"]}


def table(rows: list[dict]) -> str:
    lines = ["| measured run | jaxtron layout planned | measured tokens/s/GPU | step model (error) | roofline (error) "
             "| GEMMs at | fits |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['measured_by']} | {r['layout']} | {r['measured']:,} | compile failed: {r['error']} "
                         "| | | |")
            continue
        lines.append(f"| {r['measured_by']} | {r['layout']} | {r['measured']:,} | {r['step_model']:,.0f} "
                     f"({r['step_model_error']:+.0%}) | {r['roofline']:,.0f} ({r['roofline_error']:+.0%}) | "
                     f"{r['gemm_efficiency']:.0%} of peak | {'yes' if r['fits'] else 'no'} "
                     f"({r['peak_gib']:.1f} GiB) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", nargs="+", choices=[r[0] for r in ROWS], default=[r[0] for r in ROWS])
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for spec in ROWS:
        if spec[0] in args.rows:
            print(f"planning {spec[0]}", file=sys.stderr, flush=True)
            rows.append(row(*spec))
            with open(os.path.join(args.out, "rows.json"), "w") as f:
                json.dump(rows, f, indent=1)
    md = table(rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
