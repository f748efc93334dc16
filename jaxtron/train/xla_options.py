"""XLA compiler options a config asks for. They go to ``jax.jit`` (jaxtron/train/step.py), so the trainer, the
ahead-of-time compile and the planner (``python -m jaxtron.plan``) compile the same program."""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxtron.config import Config
from jaxtron.parallel.layout import Layout

# XLA:GPU's CollectivePipeliner for each collective kind: in a while loop (the layer scan), the collective of
# iteration i+1 is issued in iteration i, so it runs under that iteration's compute. MaxText's GPU configs set
# these (with latency-hiding scheduling, XLA's default on GPU). XLA renamed them: jaxlib 0.10 knows the booleans
# below, jaxlib 0.12 only the xla_gpu_pipeline_* enums (MaxText's --xla_gpu_pipeline_all_gather=on), and a
# compile refuses an option its XLA does not know, so :func:`pipelined_collectives` asks XLA which it takes.
PIPELINED_COLLECTIVES = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}
PIPELINED_COLLECTIVES_ENUM = {f"xla_gpu_pipeline_{kind}": "COLLECTIVE_PIPELINING_MODE_ON"
                              for kind in ("all_gather", "reduce_scatter", "all_reduce")}


def pipelined_collectives() -> dict:
    """The pipeliner options in the spelling this XLA knows (the newer names where it takes them)."""
    return dict(PIPELINED_COLLECTIVES_ENUM if xla_takes(**PIPELINED_COLLECTIVES_ENUM) else PIPELINED_COLLECTIVES)

# On by default for XLA:GPU compiles of FSDP layouts across nodes: the planner's replay of XLA's schedule (docs/planner.md,
# "Collective pipelining") puts the per-layer weight all-gathers and gradient reductions under compute.
# jax 0.12, Llama-2-70B fsdp 64 on 64 H100s: exposed comm 7.83 -> 5.98 s (MaxText 6.76 s), step 14.19 -> 12.44 s,
# peak 30.6 -> 30.8 GiB; Llama-3-70B fsdp 128: 5.72 -> 3.42 s (MaxText 3.75 s), step 19.17 -> 16.96 s, peak
# 41.4 -> 43.3 GiB. jax 0.10, Llama-2-70B: exposed comm 7.99 -> 5.89 s, step 14.37 -> 12.47 s, peak 30.6 -> 33.0 GiB
# (one layer's buffers in flight); Llama-3-70B, fsdp 128: exposed 5.70 -> 4.23 s, step 19.21 -> 17.98 s, peak
# 44.3 -> 44.0 GiB. Of MaxText's other flags only while-loop double buffering moved the replay, and both ways
# (5.60 s on the first, 5.34 s on the second), so it is left at XLA's default. The options are xla_gpu_* only:
# a CPU compile gets none (its programs, and its compile cache keys, stay as they were).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


# parallel.split_reduce_scatters: XLA:GPU's reduce-scatter combiner off (threshold 0). In the layer loop's
# backward XLA puts the weight-gradient GEMMs last and runs their reduce-scatters one at a time, each under the
# next GEMM; the last has no compute left to hide under and is waited for at the end of the iteration. Merged
# (XLA's 30 MiB default), it is gate's and up's together. Planner, jax 0.10, Llama-3-8B fsdp 8 on 8 H100
# (save_dots_attention, scan_unroll 2): exposed comm 0.210 -> 0.137 s, 10,889 -> 10,955 tokens/s/GPU;
# Llama-2-70B fsdp 64 (with the pipeliner): 5.89 -> 4.99 s, 658 -> 710; Llama-3-70B fsdp 128: 11.49 -> 10.57 s.
# Pipelined layouts reduce-scatter after the schedule, where many small collectives across nodes cost more:
# Llama-3-70B tensor 8 x stage 2 x fsdp 4 gathered once: 731.8 -> 652.5, so they keep XLA's default. So do MoE
# models, whose expert-layer backward XLA schedules otherwise: Mixtral-8x7B fsdp 64 (the peer table's row),
# 733.2 -> 728.3, exposed comm 2.15 -> 2.28 s.
SPLIT_REDUCE_SCATTERS = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 0}


# train.uninitialized_scan_outputs: XLA:GPU's pass that allocates a loop's stacked outputs uninitialized when the
# loop body writes every slice before reading it. JAX creates a scan's stacked outputs (under autodiff, the layer
# scan's residuals for the backward) filled with zeros; filling them is one write over every residual per micro
# batch, and XLA's CSE then merges the zero stacks of one shape (a SwiGLU's gate and up outputs), so that copy
# insertion copies one of them too. Planner, jax 0.10, Llama-3-8B fsdp 8 on 8 H100 (save_dots_attention,
# scan_unroll 2): memory-bound 1.87 -> 1.80 s, 10,985 -> 11,055 tokens/s/GPU (the step model still counts each
# AllocateBuffer as a write of its whole buffer).
UNINITIALIZED_SCAN_OUTPUTS = {"xla_gpu_enable_dus_accumulator_zero_init_elimination": True}


@functools.cache
def xla_takes(**options) -> bool:
    """Whether this XLA knows ``options`` (a trivial compile with them; an older XLA refuses an option it does not
    know with INVALID_ARGUMENT)."""
    try:
        jax.jit(lambda x: x).lower(jax.ShapeDtypeStruct((), jnp.float32)).compile(compiler_options=options)
    except Exception:  # noqa: BLE001 - XlaRuntimeError's class moved between jax releases
        return False
    return True


# train.latency_profile: XLA:GPU's scheduler reads its instruction costs from this file (jaxtron/plan/
# latency_profile.py). Planner, jax 0.10, with the step model's own costs, without -> with: Llama-3-70B fsdp 64 on
# 64 H100 (micro batch 2, remat full) exposed comm 2.79 -> 0.94 s, 993 -> 1,124 tokens/s/GPU (jax 0.12: 1,028 ->
# 1,128); Llama-3-8B fsdp 8 FP8 current 14,149 -> 14,255, bf16 (scan_unroll 2) 11,055 -> 11,053; Llama-2-70B
# fsdp 64 (comm-bound) 707.9 -> 709.7. A file the user gives, not a default: its names are one compile's.
LATENCY_PROFILE = "xla_gpu_pgle_profile_file_or_directory_path"


def compiler_options(cfg: Config, layout: Optional[Layout] = None) -> Optional[dict]:
    """The options for ``cfg`` on ``layout``'s devices, or None for XLA's defaults. On GPUs: the scan's stacked
    outputs allocated uninitialized (``train.uninitialized_scan_outputs``, default on, where this XLA has the
    pass) and the scheduler's latency profile (``train.latency_profile``, when given). With the weights sharded
    over ``fsdp`` too: the collective pipeliner (``parallel.collective_pipelining``, default on) when the devices
    are of more than one node (process), and the reduce-scatters left uncombined
    (``parallel.split_reduce_scatters``, default on) for a dense model without pipeline stages. Inside one node the
    pipeliner's replay reads slower (Llama-3-8B, fsdp 8 on 8 H100s, jax 0.12: step 1.66 -> 1.79 s, memory-bound
    traffic 665 -> 749 GB, exposed comm 0.08 -> 0.12 s: NVLink gathers hide under compute already, and the
    pipelined copies add memory traffic). Without a layout (no devices known) nothing is asked for."""
    if layout is None or layout.mesh is None:
        return None
    devices = list(layout.mesh.devices.flat)
    if devices[0].platform not in GPU_PLATFORMS:
        return None
    options = {}
    if cfg.train.uninitialized_scan_outputs and xla_takes(**UNINITIALIZED_SCAN_OUTPUTS):
        options.update(UNINITIALIZED_SCAN_OUTPUTS)
    if cfg.train.latency_profile:
        options[LATENCY_PROFILE] = os.path.abspath(cfg.train.latency_profile)
    if layout.fsdp == 1:
        return options or None
    nodes = len({getattr(d, "process_index", 0) for d in devices})
    if cfg.parallel.collective_pipelining and nodes > 1:
        options.update(pipelined_collectives())
    if cfg.parallel.split_reduce_scatters and layout.stages == 1 and not cfg.model.moe.num_experts:
        options.update(SPLIT_REDUCE_SCATTERS)
    return options
