"""Time the Pallas kernels against the XLA reference (and cuDNN for attention) at Llama-3-8B shapes on a GPU.

    python scripts/bench_kernels.py [--seq 2048 4096 8192] [--batch 1] [--iters 20] [--packed] [--json]
    python scripts/bench_kernels.py --check            # numerics on the GPU against the references
    python scripts/bench_kernels.py --sweep --seq 4096 # flash attention block sizes / warps / stages
    python scripts/bench_kernels.py --gmm [--tokens 8192] # MoE grouped matmul against ragged_dot
    python scripts/bench_kernels.py --fp8 [--tokens 8192] # projection GEMMs: bf16 against FP8 (model.fp8)

Shapes: heads 32, kv heads 8, head_dim 128, bf16; MLP width 14336. Each case is timed forward and
forward+backward (gradient of the sum w.r.t. every input) after a warm-up; the median of ``--iters`` runs.
Attention TFLOP/s count the causal half of the score matrix: 4 * b * s^2/2 * heads * head_dim forward
(two matmuls), 3.5x that for forward+backward (the backward has five), as FlashAttention's papers count.
``--impls``: pallas (the Triton kernels), mosaic (flash_attention(backend="mosaic"): the Mosaic GPU kernels for
Hopper, forward and backward), xla (the jnp reference), cudnn.
``--packed`` also runs each attention with 4 packed documents per row (segment ids; cuDNN gets the
equivalent dense mask, which is what jaxtron's 'cudnn' attention does); its TFLOP/s count the same causal FLOPs
as plain rows, so they are effective rates (jaxtron's kernels skip the other documents' blocks, about 3/4 of them
with 4 documents). ``--check`` compares the compiled
kernels' outputs and gradients on random inputs (relative Frobenius error) with the reference run on the same
inputs and cotangent (fp32 inside, rounded once to the input dtype: the tests' criterion, bound 2e-3 for bf16)
and, as ``*_f32``, with the fp32 reference on the same values (which a bf16 result misses by ~1.6e-3 anyway).
``--sweep`` times flash attention's forward over launch settings, then its backward settings (forward
fixed at the defaults), and prints the fastest. ``--gmm`` times the grouped matmul (pallas_kernels.grouped_matmul)
and jax.lax.ragged_dot (which XLA:GPU runs by default as a masked dense matmul, E times the FLOPs) at the expert
shapes of Mixtral 8x7B (hidden 4096, expert width 14336, 8 experts, top-2) and Qwen3-30B-A3B (2048, 768, 128,
top-8): ``--tokens`` tokens, so tokens * top-k rows with random loads, for the up (hidden -> width) and down
(width -> hidden) projections; TFLOP/s count 2 * rows * K * N forward, 3x that for forward+backward.
On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--packed", action="store_true", help="also time packed documents (segment ids)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true", help="GPU numerics against the references")
    p.add_argument("--sweep", action="store_true", help="flash attention launch-setting sweep")
    p.add_argument("--impls", nargs="+", default=["pallas", "mosaic", "xla", "cudnn"],
                   choices=["pallas", "mosaic", "mosaic-dqk", "xla", "cudnn"],
                   help="attention implementations to time (mosaic: flash_attention(backend='mosaic'), Hopper; "
                        "mosaic-dqk: the same with its separate dq kernel, fuse_dq=False)")
    p.add_argument("--attention-only", action="store_true", help="skip the RoPE and SwiGLU kernels")
    p.add_argument("--gmm", action="store_true", help="time only the MoE grouped matmul against ragged_dot")
    p.add_argument("--tokens", type=int, default=8192, help="--gmm: tokens routed (rows = tokens * top-k); "
                                                            "--fp8: rows of each GEMM")
    p.add_argument("--fp8", action="store_true", help="time only Llama-3-8B's projection GEMMs, bf16 against "
                                                     "model.fp8's recipes")
    return p.parse_args(argv)


def _time(fn, *args, iters: int, repeats: int = 5) -> float:
    """Seconds per call: ``iters`` calls dispatched back to back and blocked on once (so launch latency
    overlaps), the median over ``repeats`` such windows, after a compile + warm-up call."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _fwd_bwd(f, argnums):
    import jax
    import jax.numpy as jnp
    return jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=argnums))


def _attention_inputs(seq: int, batch: int, packed: bool):
    """Llama-3-8B attention operands in bf16 (32 heads, 8 kv heads, head_dim 128); packed: 4 documents per row."""
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.key(seq), 3)
    q = jax.random.normal(keys[0], (batch, seq, 32, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, 8, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, 8, 128), jnp.bfloat16)
    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), seq // 4)[None].repeat(batch, 0) if packed else None
    return q, k, v, seg


def attention_cases(seq: int, batch: int, packed: bool, iters: int,
                    which=("pallas", "mosaic", "xla", "cudnn")) -> list[dict]:
    import jax
    from pallas_kernels.flash_attention import flash_attention, flash_attention_reference

    h, d = 32, 128
    q, k, v, seg = _attention_inputs(seq, batch, packed)
    impls = {
        "pallas": lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg),
        "mosaic": lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg, backend="mosaic"),
        "mosaic-dqk": lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg, backend="mosaic",
                                                      fuse_dq=False),
        "xla": lambda q, k, v: flash_attention_reference(q, k, v, causal=True, segment_ids=seg),
    }

    def cudnn(q, k, v):
        mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn")
    impls["cudnn"] = cudnn

    flops_fwd = 4 * batch * seq * seq / 2 * h * d
    rows = []
    for name, f in ((n, f) for n, f in impls.items() if n in which):
        for mode, fn, flops in (("fwd", jax.jit(f), flops_fwd), ("fwd+bwd", _fwd_bwd(f, (0, 1, 2)), 3.5 * flops_fwd)):
            row = {"kernel": "attention", "impl": name, "mode": mode, "seq": seq, "packed": packed}
            try:
                s = _time(fn, q, k, v, iters=iters)
                row.update(ms=s * 1e3, tflops=flops / s / 1e12)
            except Exception as err:  # e.g. cuDNN missing, or out of memory for the XLA reference
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows.append(row)
    return rows


def elementwise_cases(seq: int, batch: int, iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.rope import apply_rope, rope_inv_freq, rope_reference
    from pallas_kernels.swiglu import swiglu, swiglu_reference

    h, kv, d, ffn = 32, 8, 128, 14336
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (batch, seq, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv, d), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    inv = rope_inv_freq(d, 500000.0)
    gate = jax.random.normal(keys[2], (batch * seq, ffn), jnp.bfloat16)
    up = jax.random.normal(keys[3], (batch * seq, ffn), jnp.bfloat16)
    cases = {
        ("rope", "pallas"): (lambda q, k: sum(x.astype(jnp.float32).sum() for x in apply_rope(q, k, pos, inv)),
                             (q, k)),
        ("rope", "xla"): (lambda q, k: rope_reference(q, pos, inv).astype(jnp.float32).sum()
                          + rope_reference(k, pos, inv).astype(jnp.float32).sum(), (q, k)),
        ("swiglu", "pallas"): (lambda g, u: swiglu(g, u), (gate, up)),
        ("swiglu", "xla"): (lambda g, u: swiglu_reference(g, u), (gate, up)),
    }
    rows = []
    for (kernel, impl), (f, args) in cases.items():
        nbytes = sum(a.size * a.dtype.itemsize for a in args)
        for mode, fn, traffic in (("fwd", jax.jit(f), 2 * nbytes), ("fwd+bwd", _fwd_bwd(f, (0, 1)), 4 * nbytes)):
            s = _time(fn, *args, iters=iters)
            rows.append({"kernel": kernel, "impl": impl, "mode": mode, "seq": seq, "ms": s * 1e3,
                         "gb_s": traffic / s / 1e9})
    return rows


# name: (hidden, expert width, experts, top-k)
GMM_MODELS = {"mixtral_8x7b": (4096, 14336, 8, 2), "qwen3_30b_a3b": (2048, 768, 128, 8)}


def _gmm_problem(tokens: int, experts: int, top_k: int, seed: int = 0):
    """Group sizes of tokens * top_k rows over the experts, with random (Dirichlet) loads."""
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(tokens * top_k, rng.dirichlet(np.full(experts, 4.0)))
    return jnp.asarray(sizes, jnp.int32)


def gmm_cases(tokens: int, iters: int, models=GMM_MODELS) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.grouped_matmul import gmm, gmm_reference

    rows = []
    for model, (hidden, width, experts, top_k) in models.items():
        sizes = _gmm_problem(tokens, experts, top_k)
        m = tokens * top_k
        for proj, (k, n) in (("up", (hidden, width)), ("down", (width, hidden))):
            keys = jax.random.split(jax.random.key(k), 2)
            lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
            rhs = (jax.random.normal(keys[1], (experts, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
            for impl, f in (("pallas", lambda a, b: gmm(a, b, sizes)),
                            ("ragged_dot", lambda a, b: gmm_reference(a, b, sizes))):
                for mode, fn, flops in (("fwd", jax.jit(f), 2 * m * k * n),
                                        ("fwd+bwd", _fwd_bwd(f, (0, 1)), 6 * m * k * n)):
                    row = {"kernel": f"gmm {model} {proj}", "impl": impl, "mode": mode, "seq": tokens}
                    try:
                        s = _time(fn, lhs, rhs, iters=iters)
                        row.update(ms=s * 1e3, tflops=flops / s / 1e12)
                    except Exception as err:  # e.g. ragged_dot's [E, rows, N] dense product out of memory
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                    rows.append(row)
    return rows


# Llama-3-8B's projections as (name, K, N): gate/up, down, QKV (q + 2 kv heads of 128), attention output
FP8_SHAPES = (("gate/up", 4096, 14336), ("down", 14336, 4096), ("qkv", 4096, 6144), ("out", 4096, 4096))


def fp8_cases(tokens: int, iters: int, shapes=FP8_SHAPES) -> list[dict]:
    """Each projection GEMM (tokens x K) @ (K x N) in bf16 and through model.fp8's recipes (jaxtron.model.fp8:
    quantization and scaling included), forward (2 t K N FLOPs) and forward+backward (3x)."""
    import jax
    import jax.numpy as jnp
    from jaxtron.model import fp8

    rows = []
    for name, k, n in shapes:
        # blockwise: the Pallas block-scaled GEMM on a GPU, its jnp reference elsewhere; 128 x 128 tiles (16 for
        # shapes too small for them)
        block = 128 if k % 128 == n % 128 == tokens % 128 == 0 else 16
        blockwise = fp8.Blockwise(block, "xla" if jax.default_backend() == "cpu" else "pallas")
        keys = jax.random.split(jax.random.key(k + n), 3)
        x = jax.random.normal(keys[0], (1, tokens, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        hist = jnp.ones((16, 3), jnp.float32)
        for recipe in ("none", "current", "delayed", "blockwise"):
            f = lambda a, b, r=recipe: fp8.dense("bsd,df->bsf", a, b, r, hist if r == "delayed" else None, 0,
                                                 blockwise)
            for mode, fn, flops in (("fwd", jax.jit(f), 2 * tokens * k * n),
                                    ("fwd+bwd", _fwd_bwd(f, (0, 1)), 6 * tokens * k * n)):
                row = {"kernel": f"gemm {name}", "impl": "bf16" if recipe == "none" else f"fp8 {recipe}",
                       "mode": mode, "seq": tokens}
                s = _time(fn, x, w, iters=iters)
                rows.append({**row, "ms": s * 1e3, "tflops": flops / s / 1e12})
    return rows


def _rel(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_cases(seq: int, batch: int) -> list[dict]:
    """Relative error of the compiled kernels (outputs and every gradient) against the references."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
    from pallas_kernels.grouped_matmul import gmm, gmm_reference
    from pallas_kernels.rope import apply_rope, rope_inv_freq, rope_reference
    from pallas_kernels.swiglu import swiglu, swiglu_reference

    rows = []

    def fwd_bwd(fn):
        @jax.jit
        def run(cot, *args):
            out, vjp = jax.vjp(fn, *args)
            return (out, *vjp(cot))
        return run

    def compare(kernel, name, f, ref, args, dtype):
        try:
            _compare(kernel, name, f, ref, args, dtype)
        except Exception as err:  # a kernel that fails to compile or run is reported, the others still checked
            rows.append({"kernel": kernel, "case": name, "dtype": jnp.dtype(dtype).name, "seq": seq,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"})

    def _compare(kernel, name, f, ref, args, dtype):
        args = [a.astype(dtype) for a in args]                 # every argument is a floating-point input
        out_type = jax.eval_shape(f, *args)
        cot = jax.random.normal(jax.random.key(7), out_type.shape, jnp.float32).astype(out_type.dtype)
        ours = fwd_bwd(f)(cot, *args)
        names = ["out"] + [f"d{i}" for i in range(len(args))]
        errs = {n: _rel(a, r) for n, a, r in zip(names, ours, fwd_bwd(ref)(cot, *args))}
        if dtype != jnp.float32:
            up = [a.astype(jnp.float32) for a in args]
            truth = fwd_bwd(ref)(cot.astype(jnp.float32), *up)
            errs.update({f"{n}_f32": _rel(a, r) for n, a, r in zip(names, ours, truth)})
        rows.append({"kernel": kernel, "case": name, "dtype": jnp.dtype(dtype).name, "seq": seq, **errs})

    h, kv, d = 32, 8, 128
    ks = jax.random.split(jax.random.key(seq + 1), 6)
    q = jax.random.normal(ks[0], (batch, seq, h, d))
    k = jax.random.normal(ks[1], (batch, seq, kv, d))
    v = jax.random.normal(ks[2], (batch, seq, kv, d))
    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), seq // 4)[None].repeat(batch, 0)
    for name, sg, fuse in (("causal mosaic", None, True), ("causal mosaic dq-kernel", None, False),
                           ("packed mosaic", seg, True)):
        compare("attention", name,
                lambda q, k, v, sg=sg, fuse=fuse: flash_attention(q, k, v, causal=True, segment_ids=sg,
                                                                  backend="mosaic", fuse_dq=fuse),
                lambda q, k, v, sg=sg: flash_attention_reference(q, k, v, causal=True, segment_ids=sg), [q, k, v],
                jnp.bfloat16)
    for dtype in (jnp.bfloat16, jnp.float32):
        for name, sg in (("causal", None), ("causal packed", seg)):
            compare("attention", name, lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=sg),
                    lambda q, k, v: flash_attention_reference(q, k, v, causal=True, segment_ids=sg),
                    [q, k, v], dtype)
        pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        inv = rope_inv_freq(d, 500000.0)
        compare("rope", "q,k", lambda q, k: jnp.concatenate([x.reshape(-1) for x in apply_rope(q, k, pos, inv)]),
                lambda q, k: jnp.concatenate([rope_reference(q, pos, inv).reshape(-1),
                                              rope_reference(k, pos, inv).reshape(-1)]), [q, k], dtype)
        gate = jax.random.normal(ks[3], (batch * seq, 14336))
        upx = jax.random.normal(ks[4], (batch * seq, 14336))
        compare("swiglu", "", swiglu, swiglu_reference, [gate, upx], dtype)
        sizes = _gmm_problem(seq, 8, 2)                   # Mixtral's routing, a narrower expert
        xk, wk = jax.random.split(ks[5])
        compare("gmm", "8 experts", lambda x, w: gmm(x, w, sizes), lambda x, w: gmm_reference(x, w, sizes),
                [jax.random.normal(xk, (seq * 2, 4096)), jax.random.normal(wk, (8, 4096, 1024)) / 64], dtype)
    rows.append(_blockwise_check(seq))
    return rows


def _blockwise_check(seq: int) -> dict:
    """The block-scaled FP8 GEMM (no backward of its own) against its jnp reference, at an 8B projection."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.fp8_blockwise import blockwise_matmul, blockwise_matmul_reference

    ks = jax.random.split(jax.random.key(7), 4)
    a = jax.random.normal(ks[0], (seq, 4096)).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(ks[1], (4096, 4096)).astype(jnp.float8_e4m3fn)
    sa, sb = jax.random.uniform(ks[2], (32, seq)), jax.random.uniform(ks[3], (32, 4096))
    row = {"kernel": "fp8 blockwise gemm", "case": "128 x 128 tiles", "dtype": "float8_e4m3fn", "seq": seq}
    try:
        return {**row, "out": _rel(blockwise_matmul(a, sa, b, sb), blockwise_matmul_reference(a, sa, b, sb))}
    except Exception as err:  # a kernel that fails is a row of the report, not the end of it
        return {**row, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}


SWEEP_FWD = [(bq, bk, w, st) for bq, bk in ((64, 64), (128, 64), (64, 128), (128, 128))
             for w in (4, 8) for st in (2, 3)]
# Mosaic forward: (block_q per warpgroup, block_k, K/V slots); larger tiles exceed shared memory or registers.
SWEEP_MOSAIC = [(64, 64, 2), (64, 64, 3), (64, 64, 4), (64, 128, 2)]
# Mosaic backward (forward at its defaults): (block_q_bwd, block_k_bwd, shared-memory slots), with dq fused into
# the dk/dv kernel (the default; three slots exceed shared memory there) and with a dq kernel of its own.
SWEEP_MOSAIC_BWD = [(64, 64, 2)]
SWEEP_MOSAIC_BWD_DQ_KERNEL = [(64, 64, 2), (64, 64, 3)]
SWEEP_BWD = [(bq, bk, w, st) for bq, bk in ((64, 64), (128, 64), (64, 128), (128, 128), (32, 64))
             for w in (4, 8) for st in (1, 2)]


def sweep_cases(seq: int, batch: int, iters: int, packed: bool) -> list[dict]:
    import jax
    from pallas_kernels.flash_attention import flash_attention

    h, d = 32, 128
    q, k, v, seg = _attention_inputs(seq, batch, packed)
    flops_fwd = 4 * batch * seq * seq / 2 * h * d
    rows = []
    grids = [("fwd", SWEEP_FWD), ("fwd+bwd", SWEEP_BWD)]
    if seg is None:
        grids.append(("mosaic fwd", [(bq, bk, None, st) for bq, bk, st in SWEEP_MOSAIC]))
        grids.append(("mosaic fwd+bwd", [(bq, bk, None, st) for bq, bk, st in SWEEP_MOSAIC_BWD]))
        grids.append(("mosaic fwd+bwd dqk", [(bq, bk, None, st) for bq, bk, st in SWEEP_MOSAIC_BWD_DQ_KERNEL]))
    for mode, grid in grids:
        for bq, bk, w, st in grid:
            if mode.startswith("mosaic fwd+bwd"):
                kw = dict(block_q_bwd=bq, block_k_bwd=bk, num_stages_bwd=st, backend="mosaic",
                          fuse_dq=mode == "mosaic fwd+bwd")
                fn = _fwd_bwd(lambda q, k, v, kw=kw: flash_attention(q, k, v, causal=True, **kw), (0, 1, 2))
                flops = 3.5 * flops_fwd
            elif mode == "mosaic fwd":
                kw = dict(block_q=bq, block_k=bk, num_stages=st, backend="mosaic")
                fn = jax.jit(lambda q, k, v, kw=kw: flash_attention(q, k, v, causal=True, **kw))
                flops = flops_fwd
            elif mode == "fwd":
                kw = dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
                fn = jax.jit(lambda q, k, v, kw=kw: flash_attention(q, k, v, causal=True, segment_ids=seg, **kw))
                flops = flops_fwd
            else:
                kw = dict(block_q_bwd=bq, block_k_bwd=bk, num_warps_bwd=w, num_stages_bwd=st)
                fn = _fwd_bwd(lambda q, k, v, kw=kw: flash_attention(q, k, v, causal=True, segment_ids=seg, **kw),
                              (0, 1, 2))
                flops = 3.5 * flops_fwd
            row = {"kernel": "attention-sweep", "mode": mode, "seq": seq, "packed": packed, "block_q": bq,
                   "block_k": bk, "num_warps": w, "num_stages": st}
            try:
                sec = _time(fn, q, k, v, iters=iters)
                row.update(ms=sec * 1e3, tflops=flops / sec / 1e12)
            except Exception as err:  # e.g. shared memory exceeded for large blocks and many stages
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    if jax.default_backend() != "gpu":
        print(f"bench_kernels.py needs an NVIDIA GPU; JAX's backend here is {jax.default_backend()!r}. "
              "Nothing timed.")
        return 0
    if args.check:
        rows = [r for seq in args.seq for r in check_cases(seq, args.batch)]
        if args.json:
            print(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}))
            return 0
        for r in rows:
            errs = r.get("error") or "  ".join(f"{k} {v:.2e}" for k, v in r.items()
                                               if k not in ("kernel", "case", "dtype", "seq"))
            print(f"check {r['kernel']:9s} {r['case']:24s} {r['dtype']:8s} seq {r['seq']:5d}  {errs}")
        return 0
    if args.sweep:
        for seq in args.seq:
            rows = sweep_cases(seq, args.batch, args.iters, args.packed)
            for mode in ("fwd", "fwd+bwd", "mosaic fwd", "mosaic fwd+bwd", "mosaic fwd+bwd dqk"):
                ok = sorted((r for r in rows if r["mode"] == mode and "ms" in r), key=lambda r: r["ms"])
                for r in ok[:3]:
                    print(f"best {mode:18s} seq {seq}: block_q {r['block_q']} block_k {r['block_k']} warps "
                          f"{r['num_warps']} stages {r['num_stages']}: {r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s")
        return 0
    if not args.json:
        print(f"device: {jax.devices()[0].device_kind}; batch {args.batch}, bf16", flush=True)
    rows = []
    if args.gmm or args.fp8:
        rows = gmm_cases(args.tokens, args.iters) if args.gmm else fp8_cases(args.tokens, args.iters)
        print(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}) if args.json
              else "\n".join(_format(r) for r in rows))
        return 0
    for seq in args.seq:
        cases = [lambda: attention_cases(seq, args.batch, False, args.iters, args.impls)]
        if args.packed:
            cases.append(lambda: attention_cases(seq, args.batch, True, args.iters, args.impls))
        if not args.attention_only:
            cases.append(lambda: elementwise_cases(seq, args.batch, args.iters))
        for case in cases:
            new_rows = case()
            rows += new_rows
            if not args.json:
                for r in new_rows:
                    print(_format(r), flush=True)  # as they come: a long run cut short keeps what it measured
    if args.json:
        print(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}))
    return 0


def _format(r: dict) -> str:
    unit = "tokens" if r["kernel"].startswith(("gmm", "gemm")) else "seq"
    what = (f"{r['kernel']:9s} {r['impl']:10s} {r['mode']:8s} {unit} {r['seq']:5d}"
            + (" packed" if r.get("packed") else ""))
    if "error" in r:
        return f"{what}  {r['error']}"
    if "tflops" in r:
        return f"{what}  {r['ms']:8.3f} ms  {r['tflops']:7.1f} TFLOP/s"
    return f"{what}  {r['ms']:8.3f} ms  {r['gb_s']:7.1f} GB/s (inputs+outputs)"

if __name__ == "__main__":
    sys.exit(main())
