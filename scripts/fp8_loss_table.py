"""Train the default model once per ``model.fp8`` recipe and print the loss table of docs/performance.md.

    python scripts/fp8_loss_table.py --out runs/fp8_table                       # bf16, every recipe, 200 steps
    python scripts/fp8_loss_table.py --out /tmp/t --steps 20 --recipes none blockwise --dtypes float32 --seed 1
    python scripts/fp8_loss_table.py --out /tmp/t --steps 2 --override model.num_layers=1 data.seq_len=64

Each run is ``python -m jaxtron.train`` (the default config: built-in corpus, 200 steps) with
``model.dtype``/``model.fp8`` set, no checkpoints, and the held-out loss of step 200 taken over
``--eval-batches`` batches (the default run's 4 leave a few percent of noise). The table reads each run's
``metrics.jsonl``: the train loss of the last step, the mean of the logged train losses over the last fifth of
the run, the held-out loss at the end, and its difference from the first row (the baseline). ``--override``
adds config overrides to every run (a smaller model for a quick check; the table is for the default one).
"""

from __future__ import annotations

import argparse
import os
import sys

from loss_runs import run, summary, table, write_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the runs' outputs")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--recipes", nargs="+", default=["none", "current", "delayed", "blockwise"],
                   choices=["none", "current", "delayed", "blockwise"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="train.seed: initialization and data order")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides for every run (the documented table uses none)")
    args = p.parse_args(argv)
    results = []
    for dtype in args.dtypes:
        for recipe in args.recipes:
            overrides = [*args.override, f"model.dtype={dtype}", f"model.fp8={recipe}"]
            path, _ = run(os.path.join(args.out, f"{dtype}_{recipe}"), overrides, args.steps, args.eval_batches,
                          args.seed)
            results.append((dtype, recipe, summary(path, args.steps)))
    write_table(args.out, table(("`model.dtype`", "`model.fp8`"), results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
