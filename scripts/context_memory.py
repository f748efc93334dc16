"""Per-device memory of the train step compiled by XLA:GPU for 8 H100s, per context size and context_impl.

    python scripts/context_memory.py [--config llama3_1_8b] [--seq-len 32768] [--contexts 1 2 4 8]
                                     [--impls all_gather ring ulysses] [--num-gpus 8] [section.field=value ...]

Each row is ``python -m jaxtron.plan`` (the real XLA:GPU compiler, no GPU needed; needs the CUDA compiler
plugin of the ``plan``/``test`` extra) with ``parallel.context=C``, ``parallel.fsdp=N/C`` (ZeRO-3 spans fsdp x
context, so the model state per device is the same in every row) and one sequence per data-parallel replica:
each device holds seq/C tokens. Attention is ``xla`` in every row (the kernels do not take context > 1 yet),
so the seq x seq score blocks are in the temp figures. Prints a markdown table; ``--json`` one object per row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

GIB = 2 ** 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_1_8b")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--impls", nargs="+", default=["all_gather", "ring"], choices=["all_gather", "ring", "ulysses"])
    p.add_argument("--num-gpus", type=int, default=8)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    return p.parse_intermixed_args(argv)


def plan_row(args, context: int, impl: str) -> dict:
    fsdp = args.num_gpus // context
    cmd = [sys.executable, "-m", "jaxtron.plan", "--json", "--config", args.config, "--gpu", args.gpu,
           "--num-gpus", str(args.num_gpus), f"data.seq_len={args.seq_len}", f"parallel.context={context}",
           f"parallel.context_impl={impl}", f"parallel.fsdp={fsdp}", "parallel.data=1", "parallel.tensor=1",
           "model.attention_impl=xla", f"train.global_batch_size={fsdp}", "train.micro_batch_size=1",
           *args.overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: context {context} {impl}: {proc.stderr.strip().splitlines()[-1]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    m = r["memory"]
    return {"context": context, "impl": impl, "tokens_per_device": args.seq_len // context,
            "state_gib": (m["params"] + m["optimizer"]) / GIB, "temp_gib": m["temp"] / GIB,
            "activations_and_temp_gib": m["activations_and_temp"] / GIB, "peak_gib": m["peak"] / GIB,
            "fits": m["fits"], "async_overlap": r.get("async_overlap", {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for impl in args.impls:
        for c in args.contexts:
            if c == 1 and rows and any(r["context"] == 1 for r in rows):
                continue  # context 1 is the same program for every impl
            rows.append(plan_row(args, c, impl))
            if c == 1:
                rows[-1]["impl"] = "(none)"
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        return 0
    base = next((r for r in rows if r["context"] == 1), None)
    print(f"{args.config}, seq {args.seq_len}, {args.num_gpus} x {args.gpu}, fsdp x context = {args.num_gpus}, "
          "attention xla (GiB per device, XLA:GPU memory analysis)\n")
    print("| context | impl | tokens/device | model state | activations + temp | vs context 1 x 1/C | peak | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = ("" if base is None or r is base else
                 f"{r['activations_and_temp_gib'] / (base['activations_and_temp_gib'] / r['context']):.2f}")
        print(f"| {r['context']} | {r['impl']} | {r['tokens_per_device']} | {r['state_gib']:.2f} | "
              f"{r['activations_and_temp_gib']:.2f} | {ratio} | {r['peak_gib']:.2f} | {'yes' if r['fits'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
