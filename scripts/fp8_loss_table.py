"""Train the default model once per ``model.fp8`` recipe and print the loss table of docs/performance.md.

    python scripts/fp8_loss_table.py --out runs/fp8_table                       # bf16, every recipe, 200 steps
    python scripts/fp8_loss_table.py --out /tmp/t --steps 20 --recipes none blockwise --dtypes float32 --seed 1

Each run is ``python -m jaxtron.train`` (the default config: built-in corpus, 200 steps) with
``model.dtype``/``model.fp8`` set, no checkpoints, and the held-out loss of step 200 taken over
``--eval-batches`` batches (the default run's 4 leave a few percent of noise). The table reads each run's
``metrics.jsonl``: the train loss of the last step, the mean of the logged train losses over the last fifth of
the run, the held-out loss at the end, and its difference from the first row (the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def run(out: str, dtype: str, recipe: str, steps: int, eval_batches: int, seed: int = 0) -> str:
    out_dir = os.path.join(out, f"{dtype}_{recipe}")
    cmd = [sys.executable, "-m", "jaxtron.train", f"train.output_dir={out_dir}", "checkpoint.enabled=false",
           f"model.dtype={dtype}", f"model.fp8={recipe}", f"train.steps={steps}", f"train.eval_every={steps}",
           f"train.eval_batches={eval_batches}", f"train.seed={seed}", "logging.progress=false",
           "logging.tensorboard=false"]
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(out_dir, "metrics.jsonl")


def summary(metrics_path: str, steps: int) -> dict:
    rows = [json.loads(line) for line in open(metrics_path)]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    tail = [loss for step, loss in train if step > steps - steps // 5 - 1]
    held_out = [r["eval_loss"] for r in rows if "eval_loss" in r and r["step"] == steps]
    return {"train": train[-1][1], "train_tail_mean": sum(tail) / len(tail), "held_out": held_out[-1]}


def table(results: list[tuple[str, str, dict]]) -> str:
    base = results[0][2]["held_out"]
    lines = ["| `model.dtype` | `model.fp8` | train loss, last step | mean of the logged train losses, last fifth "
             "| held-out loss, last step | held-out vs first row |", "|---|---|---|---|---|---|"]
    for i, (dtype, recipe, s) in enumerate(results):
        delta = "" if i == 0 else f"{100 * (s['held_out'] / base - 1):+.1f}%"
        lines.append(f"| {dtype} | {recipe} | {s['train']:.4f} | {s['train_tail_mean']:.4f} | {s['held_out']:.4f} "
                     f"| {delta} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the runs' outputs")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--recipes", nargs="+", default=["none", "current", "delayed", "blockwise"],
                   choices=["none", "current", "delayed", "blockwise"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="train.seed: initialization and data order")
    args = p.parse_args(argv)
    results = []
    for dtype in args.dtypes:
        for recipe in args.recipes:
            path = run(args.out, dtype, recipe, args.steps, args.eval_batches, args.seed)
            results.append((dtype, recipe, summary(path, args.steps)))
    md = table(results)
    print(md)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
