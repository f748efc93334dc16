"""Checkpoint speed: the blocking part and the total of an asynchronous save, and restore throughput, for a real
train state (params + AdamW moments, fp32) sharded over 8 CPU devices (FSDP).

    python scripts/bench_checkpoint.py [--dir DIR] [--repeats 3] [--orbax-baseline] [--json] [overrides ...]

The default model (hidden 1024, 7 layers, vocab 32000) has 175M parameters: a 1.96 GiB train state.
Reported:
- save: ``blocking_s`` is how long ``Checkpointer.save`` holds the training loop; ``total_s`` runs until the
  checkpoint is complete on disk (fsync'ed and renamed into place).
- restore, same layout (fsdp 8), in this process and in a fresh process (memory the process never touched:
  the number a restarted job sees, with the files in the page cache);
- restore onto another layout (data 2, fsdp 2, tensor 2): resharding on read;
- ``verify``: ``python -m jaxtron.checkpoint verify`` of the saved step (sizes and checksums, no JAX);
- ``--orbax-baseline``: the same state with Orbax's own StandardCheckpointer (OCDBT), for comparison.
GiB/s = state bytes / wall seconds until every restored array is ready. Saves checksum every shard file and
read each back before the step is finalized (``JAXTRON_CHECKPOINT_VERIFY_SAVE=0`` skips the read-back);
restores check every file's checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = ["model.hidden_size=1024", "model.num_layers=7", "model.num_heads=16", "model.num_kv_heads=8",
         "model.intermediate_size=4096", "model.vocab_size=32000", "model.dtype=float32",
         "train.global_batch_size=8", "data.seq_len=16"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where to write (default: a new temporary directory, removed after)")
    p.add_argument("--repeats", type=int, default=3, help="timed saves and restores of each kind")
    p.add_argument("--orbax-baseline", action="store_true", help="also time Orbax's StandardCheckpointer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--restore-only", default=None, help=argparse.SUPPRESS)  # the fresh-process restore
    p.add_argument("--format", default="jaxtron", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides for the model (default: the 1.96 GiB model)")
    return p.parse_intermixed_args(argv)


def _setup(overrides, layout):
    from jaxtron import config as config_lib
    from jaxtron.train.trainer import Trainer
    cfg = config_lib.load(None, MODEL + list(overrides) + list(layout))
    return Trainer(cfg)


def _nbytes(tree) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _timed_restore(directory, step, abstract):
    import jax
    from jaxtron.checkpoint import Checkpointer
    ckpt = Checkpointer(directory)
    t0 = time.perf_counter()
    state, _ = ckpt.restore(step, abstract)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    ckpt.close()
    return state, seconds


FSDP8 = ("parallel.data=1", "parallel.fsdp=8")
MIXED = ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")


def restore_only(args) -> dict:
    import jax
    run = _setup(args.overrides, FSDP8)
    if args.format == "orbax":
        import orbax.checkpoint as ocp
        abstract = run.spec.abstract_state
        mngr = ocp.CheckpointManager(args.restore_only)
        t0 = time.perf_counter()
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(
            {"params": abstract["params"], "opt_state": abstract["opt_state"]}))
        jax.block_until_ready(state)
        seconds = time.perf_counter() - t0
        mngr.close()
        prefix = "orbax_fresh_process_restore"
    else:
        state, seconds = _timed_restore(args.restore_only, 1, run.spec.abstract_state)
        prefix = "fresh_process_restore"
    gib = _nbytes(state) / 2**30
    return {f"{prefix}_s": seconds, f"{prefix}_gib_s": gib / seconds}


def _fresh_process_restore(directory, fmt, overrides) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--restore-only", directory, "--format", fmt, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fresh-process restore failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.restore_only:
        print(json.dumps(restore_only(args)))
        return 0
    import jax
    import numpy as np
    from jaxtron.checkpoint import Checkpointer

    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    os.makedirs(root, exist_ok=True)
    out: dict = {"devices": jax.device_count(), "platform": jax.devices()[0].platform}
    try:
        run = _setup(args.overrides, FSDP8)
        state = jax.block_until_ready(run.state)
        nbytes = _nbytes(state)
        out["state_gib"] = nbytes / 2**30
        out["params"] = int(sum(x.size for x in jax.tree.leaves(state["params"])))

        ckpt_dir = os.path.join(root, "jaxtron")
        ckpt = Checkpointer(ckpt_dir, keep=1)
        blocking, total = [], []
        for step in range(args.repeats + 1):  # the first save is reported apart (first use of the I/O paths)
            t0 = time.perf_counter()
            ckpt.save(step, state, {})
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            blocking.append(t1 - t0)
            total.append(t2 - t0)
        ckpt.close()
        last = args.repeats
        os.rename(os.path.join(ckpt_dir, str(last)), os.path.join(ckpt_dir, "1"))  # a fixed step for restores
        out["first_save_blocking_s"], out["first_save_total_s"] = blocking[0], total[0]
        out["save_blocking_s"] = statistics.median(blocking[1:])
        out["save_blocking_max_s"] = max(blocking[1:])
        out["save_total_s"] = statistics.median(total[1:])
        out["save_gib_s"] = out["state_gib"] / out["save_total_s"]

        saved = jax.device_get(state["params"]["embed"])
        if args.orbax_baseline:
            orbax_dir = os.path.join(root, "orbax")
            out.update(_orbax_baseline(orbax_dir, state, run.spec.abstract_state, args.repeats))
        del state
        run.state = None
        out.update(_fresh_process_restore(ckpt_dir, "jaxtron", args.overrides))
        if args.orbax_baseline:
            out.update(_fresh_process_restore(orbax_dir, "orbax", args.overrides))

        times = []
        for _ in range(args.repeats):
            restored, seconds = _timed_restore(ckpt_dir, 1, run.spec.abstract_state)
            times.append(seconds)
            np.testing.assert_array_equal(np.asarray(restored["params"]["embed"]), saved)
            del restored
        out["restore_s"] = statistics.median(times)
        out["restore_gib_s"] = out["state_gib"] / out["restore_s"]
        out["restore_gib_s_best"] = out["state_gib"] / min(times)

        from jaxtron.checkpoint.integrity import verify_path
        t0 = time.perf_counter()
        problems, _ = verify_path(os.path.join(ckpt_dir, "1"))
        assert not problems, problems
        out["verify_s"] = time.perf_counter() - t0
        out["verify_gib_s"] = out["state_gib"] / out["verify_s"]

        other = _setup(args.overrides, MIXED)
        times = []
        for _ in range(args.repeats):
            restored, seconds = _timed_restore(ckpt_dir, 1, other.spec.abstract_state)
            times.append(seconds)
            np.testing.assert_array_equal(np.asarray(restored["params"]["embed"]), saved)
            del restored
        out["reshard_restore_s"] = statistics.median(times)
        out["reshard_restore_gib_s"] = out["state_gib"] / out["reshard_restore_s"]
        del other

        if args.orbax_baseline:
            out.update(_orbax_restore(orbax_dir, run.spec.abstract_state, args.repeats))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    return 0


def _orbax_baseline(directory, state, abstract, repeats) -> dict:
    import orbax.checkpoint as ocp
    tree = {"params": state["params"], "opt_state": state["opt_state"]}
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=1))
    blocking, total = [], []
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        mngr.save(step, args=ocp.args.StandardSave(tree))
        t1 = time.perf_counter()
        mngr.wait_until_finished()
        blocking.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    mngr.close()
    return {"orbax_save_blocking_s": statistics.median(blocking[1:]), "orbax_save_total_s": statistics.median(total[1:])}


def _orbax_restore(directory, abstract, repeats) -> dict:
    import jax
    import orbax.checkpoint as ocp
    target = {"params": abstract["params"], "opt_state": abstract["opt_state"]}
    gib = _nbytes(target) / 2**30
    mngr = ocp.CheckpointManager(directory)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(target))
        jax.block_until_ready(restored)
        times.append(time.perf_counter() - t0)
        del restored
    mngr.close()
    return {"orbax_restore_s": statistics.median(times), "orbax_restore_gib_s": gib / statistics.median(times)}


if __name__ == "__main__":
    sys.exit(main())
