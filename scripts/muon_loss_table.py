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
import os
import sys

from loss_runs import run, summary, table, write_table


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
        lr = lr or "1e-3"
        path, seconds = run(os.path.join(args.out, f"{name}_{lr}"), [f"optim.name={name}", f"optim.lr={lr}"],
                            args.steps, args.eval_batches, args.seed)
        print(f"{item}: {seconds:.0f} s", file=sys.stderr, flush=True)
        results.append((name, lr, summary(path, args.steps)))
    write_table(args.out, table(("`optim.name`", "`optim.lr`"), results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
