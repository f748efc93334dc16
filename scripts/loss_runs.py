"""What the loss-table scripts (fp8_loss_table.py, muon_loss_table.py) share: one ``python -m jaxtron.train``
run per row with some overrides and no checkpoints, the figures read back from its ``metrics.jsonl`` (the train
loss of the last step, the mean of the logged train losses over the last fifth, the held-out loss at the end),
and the markdown table with each row's held-out loss against the first row's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Sequence


def run(out_dir: str, overrides: Sequence[str], steps: int, eval_batches: int, seed: int) -> tuple[str, float]:
    """Train into ``out_dir`` with ``overrides``; (its metrics.jsonl, wall seconds)."""
    cmd = [sys.executable, "-m", "jaxtron.train", f"train.output_dir={out_dir}", "checkpoint.enabled=false",
           *overrides, f"train.steps={steps}", f"train.eval_every={steps}", f"train.eval_batches={eval_batches}",
           f"train.seed={seed}", "logging.progress=false", "logging.tensorboard=false"]
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


def table(columns: tuple[str, str], results: list[tuple[str, str, dict]]) -> str:
    """One row per ``(first column, second column, summary)``, headed by ``columns``."""
    base = results[0][2]["held_out"]
    lines = [f"| {columns[0]} | {columns[1]} | train loss, last step | mean of the logged train losses, last fifth "
             "| held-out loss, last step | held-out vs first row |", "|---|---|---|---|---|---|"]
    for i, (a, b, s) in enumerate(results):
        delta = "" if i == 0 else f"{100 * (s['held_out'] / base - 1):+.1f}%"
        lines.append(f"| {a} | {b} | {s['train']:.4f} | {s['train_tail_mean']:.4f} | {s['held_out']:.4f} "
                     f"| {delta} |")
    return "\n".join(lines)


def write_table(out: str, md: str) -> None:
    print(md)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(md + "\n")
