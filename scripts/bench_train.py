"""Time the jitted train step on a synthetic batch: compile seconds, steady-state s/step, tokens/s, TFLOP/s, MFU.

    python scripts/bench_train.py [--config PRESET_OR_YAML] [--cpu-devices N] [--warmup 3] [--steps 20] [--json]
                                  [section.field=value ...]

``--cpu-devices N`` appends ``--xla_force_host_platform_device_count=N`` to XLA_FLAGS before jax is imported.
The batch is random tokens with the keys and dtypes of the built-in corpus; the same batch is fed every step.
The timed window dispatches ``--steps`` steps back to back and blocks once, at its end.
TFLOP/s and MFU use Megatron's FLOPs per token (``jaxtron.train.flops``); for MoE models that counts the active
parameters (the top-k routed and the shared experts), not every expert, nor the extra work of a fallback that
runs every expert on every token (ragged_dot on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a preset name or a YAML file (default: the built-in defaults)")
    p.add_argument("--cpu-devices", type=int, default=None, help="force N host-platform (CPU) devices")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--sync-each-step", action="store_true",
                   help="wait for every step's metrics and report the median step time as well (steadier on a "
                        "shared machine; costs the overlap of one step's dispatch with the previous step)")
    p.add_argument("--documents", type=int, default=1,
                   help="packed documents per row: segment ids and positions restart (sets data.reset_at_eod=true)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. parallel.fsdp=4")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after options
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def synthetic_batch(global_batch: int, seq_len: int, vocab: int, seed: int = 0,
                    documents: int = 1) -> dict[str, np.ndarray]:
    """Random tokens laid out as the corpus lays out a batch (nothing masked); with ``documents`` > 1 each row
    packs that many equal documents (segment ids 1..documents, positions restarting at each)."""
    win = np.random.default_rng(seed).integers(0, vocab, size=(global_batch, seq_len + 1), dtype=np.int32)
    shape = (global_batch, seq_len)
    doc_len = -(-seq_len // documents)
    idx = np.arange(seq_len, dtype=np.int32)
    return {"inputs": win[:, :-1].copy(), "targets": win[:, 1:].copy(),
            "positions": np.broadcast_to(idx % doc_len, shape).copy(),
            "segment_ids": np.broadcast_to(idx // doc_len + 1, shape).astype(np.int32),
            "loss_mask": np.ones(shape, np.float32)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:  # must happen before jax is imported
        flag = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    from jaxtron import config as config_lib
    try:
        cfg = config_lib.load(args.config, args.overrides + (["data.reset_at_eod=true"] if args.documents > 1 else []))
    except config_lib.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import jax
    from jaxtron.plan.model import param_count
    from jaxtron.train.flops import flops_per_token
    from jaxtron.train.trainer import Trainer, put_batch
    from jaxtron.train.metrics import device_memory

    try:
        run = Trainer(cfg)
    except config_lib.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    t, seq = cfg.train, cfg.data.seq_len
    batch = put_batch(synthetic_batch(t.global_batch_size, seq, cfg.model.vocab_size, t.seed, args.documents),
                      run.batch_sharding)

    t0 = time.perf_counter()
    step = run.train_step.lower(run.state, batch).compile()
    compile_s = time.perf_counter() - t0
    compiled_memory = step.memory_analysis()

    state = run.state
    for _ in range(args.warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    ends = []
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        if args.sync_each_step:
            jax.block_until_ready(metrics)
            ends.append(time.perf_counter())
    jax.block_until_ready((state, metrics))
    step_s = (time.perf_counter() - t0) / args.steps
    step_s_median = float(np.median(np.diff([t0] + ends))) if ends else None
    run.state = state

    n = run.num_devices
    tps = t.global_batch_size * seq / step_s
    out = {
        "devices": n, "device_kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
        "mesh": dict(run.layout.sizes), "dtype": config_lib.compute_dtype(cfg.model), "remat": cfg.model.remat,
        "attention_impl": cfg.model.attention_impl,
        "global_batch_size": t.global_batch_size, "seq_len": seq, "documents_per_row": args.documents,
        "accumulation_steps": run.layout.accumulation_steps,
        "pipeline": ({"stages": run.layout.stages, "schedule": cfg.parallel.pipeline_schedule,
                      "virtual_stages": cfg.parallel.virtual_stages, "bubble": run.layout.bubble}
                     if run.layout.stages > 1 else None),
        "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(state["params"]))),
        "active_params": param_count(cfg.model, active=True), "moe_experts": cfg.model.moe.num_experts,
        "flops_per_token_full": flops_per_token(cfg.model, seq, "full"),
        "compile_s": compile_s, "warmup_steps": args.warmup, "timed_steps": args.steps,
        "step_s": step_s, "step_s_median": step_s_median, "tokens_per_s": tps, "tokens_per_s_per_device": tps / n,
        "final_loss": float(metrics["loss"]),
        "peak_tflops_per_device": run.peak_flops / 1e12 if run.peak_flops else None,
        "fp8": cfg.model.fp8,
        # XLA's figures for the compiled step, and what the device itself saw (GPUs report it; CPUs do not)
        "compiled_temp_bytes": getattr(compiled_memory, "temp_size_in_bytes", None),
        "compiled_argument_bytes": getattr(compiled_memory, "argument_size_in_bytes", None),
        "device_peak_gib": device_memory().get("memory_peak_gib"),
    }
    for conv in ("full", "causal"):
        tflops = flops_per_token(cfg.model, seq, conv) * tps / n / 1e12
        out[f"tflops_per_device_{conv}"] = tflops
        out[f"mfu_{conv}"] = tflops * 1e12 / run.peak_flops if run.peak_flops else None

    if args.json:
        print(json.dumps(out))
        return 0
    mesh = " x ".join(f"{a} {s}" for a, s in out["mesh"].items() if s > 1) or "1 device"
    print(f"devices      {n} x {out['device_kind']} ({out['platform']}); mesh {mesh}")
    active = (f" ({out['active_params'] / 1e6:.2f}M active per token, top-{cfg.model.moe.num_experts_per_token} of "
              f"{out['moe_experts']} experts: FLOPs count these)" if out["moe_experts"] else "")
    print(f"model        {out['params'] / 1e6:.2f}M params{active}, dtype {out['dtype']}, remat {out['remat']}; "
          f"batch {t.global_batch_size} x {seq}, accumulation {out['accumulation_steps']}")
    if out["pipeline"]:
        pp = out["pipeline"]
        print(f"pipeline     {pp['schedule']}, {pp['stages']} stages"
              + (f" x {pp['virtual_stages']} virtual" if pp["schedule"] == "circular" else "")
              + f", {out['accumulation_steps']} micro batches, bubble {100 * pp['bubble']:.1f}%")
    print(f"compile      {compile_s:.2f} s")
    print(f"step         {step_s * 1e3:.2f} ms (mean of {args.steps} after {args.warmup} warmup)"
          + (f", median {step_s_median * 1e3:.2f} ms" if step_s_median is not None else ""))
    print(f"tokens/s     {tps:,.0f} global, {tps / n:,.0f} per device")
    for conv in ("full", "causal"):
        mfu = out[f"mfu_{conv}"]
        print(f"TFLOP/s/dev  {out[f'tflops_per_device_{conv}']:.4f} ({conv} attention)"
              + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ", MFU n/a (peak unknown)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
