"""Why ``jaxtron/model/projection.py`` accumulates CPU matmuls in fp32: times one bf16 matmul on XLA:CPU three
ways (bf16 result, fp32-accumulated result rounded to bf16, fp32 inputs). Some XLA:CPU versions (JAX 0.10)
run the first on the fp32 kernel after converting both operands.

    JAX_PLATFORMS=cpu python scripts/bench_cpu_matmul.py [--tokens 2048] [--width 256] [--out 1024]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", type=int, default=1024)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    x = jnp.ones((args.tokens, args.width), jnp.bfloat16)
    w = jnp.ones((args.width, args.out), jnp.bfloat16)
    ways = {
        "bf16 x bf16 -> bf16": lambda x, w: x @ w,
        "bf16 x bf16 -> fp32 (then rounded)": lambda x, w: jnp.einsum(
            "td,df->tf", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
        "fp32 x fp32 -> fp32": lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32),
    }
    print(f"{jax.devices()[0].device_kind}: [{args.tokens}, {args.width}] x [{args.width}, {args.out}]")
    for name, fn in ways.items():
        compiled = jax.jit(fn).lower(x, w).compile()
        for _ in range(3):
            compiled(x, w).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            out = compiled(x, w)
        out.block_until_ready()
        ms = (time.perf_counter() - t0) / args.iters * 1e3
        print(f"  {name:36s} {ms:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
