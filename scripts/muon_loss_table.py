"""Train the default (tiny) model with AdamW and with Muon on the same tokens and print the loss table of
docs/optimizers.md.

    python scripts/muon_loss_table.py --out runs/muon_table                      # 200 steps, both optimizers
    python scripts/muon_loss_table.py --out /tmp/t --steps 20 --runs adamw:1e-3 muon:1e-3 muon:3e-3

Each run is ``python -m jaxtron.train`` (the default config: built-in corpus, batch 8 x 256 tokens, cosine
schedule with 20 warmup steps, weight decay 0.1, the same seed, so the same initialization and data order)
with ``optim.name`` and ``optim.lr`` set and no checkpoints. Muon runs with its default RMS matching
(``optim.muon_rms=0.2``), which is meant to take AdamW's learning rate unchanged. The table reads each run's
``metrics.jsonl``: the train loss of the last step, the mean of the logged train losses over the last fifth, the
held-out loss at the end (``--eval-batches`` batches) and its difference from the first row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run(out: str, name: str, lr: str, steps: int, eval_batches: int, seed: int) -> tuple[str, float]:
    out_dir = os.path.join(out, f"{name}_{lr}")
    cmd = [sys.executable, "-m", "jaxtron.train", f"train.output_dir={out_dir}", "checkpoint.enabled=false",
           f"optim.name={name}", f"optim.lr={lr}", f"train.steps={steps}", f"train.eval_every={steps}",
           f"train.eval_batches={eval_batches}", f"train.seed={seed}", "logging.progress=false",
           "logging.tensorboard=false"]
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(out_dir, "metrics.jsonl"), time.perf_counter() - start


def summary(metrics_path: str, steps: int) -> dict:
    rows = [json.loads(line) for line in open(metrics_path)]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    tail = [loss for step, loss in train if step > steps - steps // 5 - 1]
    held_out = [r["eval_loss"] for r in rows if "eval_loss" in r and r["step"] == steps]
    return {"train": train[-1][1], "train_tail_mean": sum(tail) / len(tail), "held_out": held_out[-1]}


def table(results: list[tuple[str, str, dict]]) -> str:
    base = results[0][2]["held_out"]
    lines = ["| `optim.name` | `optim.lr` | train loss, last step | mean of the logged train losses, last fifth "
             "| held-out loss, last step | held-out vs first row |", "|---|---|---|---|---|---|"]
    for i, (name, lr, s) in enumerate(results):
        delta = "" if i == 0 else f"{100 * (s['held_out'] / base - 1):+.1f}%"
        lines.append(f"| {name} | {lr} | {s['train']:.4f} | {s['train_tail_mean']:.4f} | {s['held_out']:.4f} "
                     f"| {delta} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the runs' outputs")
    p.add_argument("--runs", nargs="+", default=["adamw:1e-3", "muon:1e-3"], help="NAME:LR pairs, in table order")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="train.seed: initialization and data order")
    args = p.parse_args(argv)
    results = []
    for item in args.runs:
        name, _, lr = item.partition(":")
        path, seconds = run(args.out, name, lr or "1e-3", args.steps, args.eval_batches, args.seed)
        print(f"{item}: {seconds:.0f} s", file=sys.stderr, flush=True)
        results.append((name, lr or "1e-3", summary(path, args.steps)))
    md = table(results)
    print(md)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
