"""Time GEMMs by shape and dtype on this machine's first device: the planner's measured GEMM table.

    python scripts/gemm_table.py --out runs/gemm_table.json                 # on one GPU: a few minutes
    python scripts/gemm_table.py --out /tmp/gemm_table.json --tiny          # small shapes, bf16: the CPU path

Each entry is one (M x K) @ (K x N) GEMM, bf16 operands with a bf16 result, or FP8 (e4m3) operands with a bf16
result (what XLA:GPU sends to cuBLASLt's FP8 GEMM on Hopper): its median seconds over back-to-back calls
(``scripts/bench_kernels.py``'s timer) and TFLOP/s = 2 M N K / seconds. The shapes are the projections of
Llama-3.2-1B, Llama-3-8B and Llama-3-70B (and their LM heads' widths) at 1k to 16k rows, which covers what
the planner meets in those models' steps; others are interpolated by the GEMM model (jaxtron/plan/gemm.py).

Use it with ``python -m jaxtron.plan --gemm-table FILE``; copy a GPU's table to
``jaxtron/plan/gemm_tables/<gpu>.json`` (h100, h200) and commit it to make it that GPU's default.
``scripts/gpu_report.py`` runs this script and passes its table to its planner parts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS = (1024, 4096, 8192, 16384)
# (K, N): Llama-3.2-1B (2048 wide), Llama-3-8B (4096), Llama-3-70B (8192): QKV, attention output, gate/up, down
WIDTHS = ((2048, 3072), (2048, 2048), (2048, 8192), (8192, 2048),
          (4096, 6144), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256),
          (8192, 10240), (8192, 8192), (8192, 28672), (28672, 8192))
TINY_ROWS = (64, 256)
TINY_WIDTHS = ((64, 64), (256, 128), (128, 512))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON table to write")
    p.add_argument("--tiny", action="store_true", help="small shapes (the CPU path, seconds)")
    p.add_argument("--dtypes", nargs="+", choices=("bf16", "fp8"), default=None,
                   help="default: bf16 and fp8 on a GPU, bf16 elsewhere")
    p.add_argument("--iters", type=int, default=20, help="calls per timing window")
    return p.parse_args(argv)


def measure(rows, widths, dtypes, iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from bench_kernels import _time

    gemm = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16))
    out = []
    for dtype in dtypes:
        for k, n in widths:
            for m in rows:
                keys = jax.random.split(jax.random.key(m + k + n), 2)
                a = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
                b = (jax.random.normal(keys[1], (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
                if dtype == "fp8":
                    a, b = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
                seconds = _time(gemm, a, b, iters=iters)
                out.append({"m": m, "n": n, "k": k, "dtype": dtype, "seconds": seconds,
                            "tflops": 2.0 * m * n * k / seconds / 1e12})
                print(f"{dtype} {m}x{k} @ {k}x{n}: {seconds * 1e3:.3f} ms, {out[-1]['tflops']:.1f} TFLOP/s",
                      file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    device = jax.devices()[0]
    gpu = device.platform in ("gpu", "cuda")
    dtypes = args.dtypes or (["bf16", "fp8"] if gpu else ["bf16"])
    rows, widths = (TINY_ROWS, TINY_WIDTHS) if args.tiny else (ROWS, WIDTHS)
    entries = measure(rows, widths, dtypes, args.iters)
    table = {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
             "command": "python scripts/gemm_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
             "entries": entries}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    print(json.dumps({"table": args.out, "entries": len(entries), "dtypes": dtypes,
                      "device_kind": device.device_kind}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
