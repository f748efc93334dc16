"""Per-device temporary memory of the compiled train step for each pipeline schedule and micro batch count.

    python scripts/pipeline_memory.py [--micro-batches 4 8 16 64] [--schedules 1f1b gpipe circular]
                                      [--cpu-devices 8] [--json] [section.field=value ...]

Compiles the real train step ahead of time on abstract inputs (nothing is allocated) with
``train.global_batch_size = M x micro_batch_size x data x fsdp`` and prints XLA's ``memory_analysis()``:
temp (activations, gradient accumulators, pipeline buffers) and arguments (the train state and batch).
Defaults: an 8-layer width-256 model, seq 256, micro batch 2, on stage 4 x fsdp 2 of 8 CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULTS = ["model.num_layers=8", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
            "model.intermediate_size=768", "model.vocab_size=256", "model.dtype=float32", "data.seq_len=256",
            "parallel.stage=4", "parallel.fsdp=2", "parallel.data=1", "parallel.tensor=1",
            "train.micro_batch_size=2", "parallel.virtual_stages=1"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16, 64])
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "circular"],
                   choices=["1f1b", "gpipe", "circular"])
    p.add_argument("--virtual-stages", type=int, default=2, help="for the circular schedule")
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    return p.parse_intermixed_args(argv)


def temp_memory(overrides: list[str]) -> dict:
    """Compile the train step for these config overrides; XLA's per-device memory figures in bytes."""
    import jax
    from jaxtron import config as config_lib
    from jaxtron.train.aot import lower_train_step_with_spec

    cfg = config_lib.load(None, overrides)
    lowered, _, _ = lower_train_step_with_spec(cfg, jax.devices())
    mem = lowered.compile().memory_analysis()
    return {"temp": int(mem.temp_size_in_bytes), "arguments": int(mem.argument_size_in_bytes)}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    from jaxtron import config as config_lib

    base = config_lib.load(None, DEFAULTS + args.overrides, validate_config=False)
    dp = base.parallel.data * base.parallel.fsdp
    rows = []
    for schedule in args.schedules:
        for m in args.micro_batches:
            ov = DEFAULTS + args.overrides + [
                f"parallel.pipeline_schedule={schedule}",
                f"train.global_batch_size={m * base.train.micro_batch_size * dp}"]
            if schedule == "circular":
                ov.append(f"parallel.virtual_stages={args.virtual_stages}")
            try:
                rows.append({"schedule": schedule, "micro_batches": m, **temp_memory(ov)})
            except config_lib.ConfigError as err:
                rows.append({"schedule": schedule, "micro_batches": m, "error": str(err)})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"stage {base.parallel.stage} x fsdp {base.parallel.fsdp} x tensor {base.parallel.tensor} x data "
          f"{base.parallel.data}; micro batch {base.train.micro_batch_size} x seq {base.data.seq_len}, "
          f"{base.model.num_layers} layers of width {base.model.hidden_size}")
    print(f"{'schedule':9s} {'M':>4s} {'temp MiB':>10s} {'args MiB':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']:9s} {r['micro_batches']:4d}  {r['error']}")
        else:
            print(f"{r['schedule']:9s} {r['micro_batches']:4d} {r['temp'] / 2**20:10.1f} {r['arguments'] / 2**20:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
