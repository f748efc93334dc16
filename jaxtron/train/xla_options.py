"""XLA compiler options a config asks for. They go to ``jax.jit`` (jaxtron/train/step.py), so the trainer, the
ahead-of-time compile and the planner (``python -m jaxtron.plan``) compile the same program."""

from __future__ import annotations

from typing import Optional

from jaxtron.config import Config

# XLA:GPU's CollectivePipeliner for each collective kind: in a while loop (the layer scan), the collective of
# iteration i+1 is issued in iteration i, so it runs under that iteration's compute. MaxText's GPU configs set
# these (with latency-hiding scheduling, XLA's default on GPU).
PIPELINED_COLLECTIVES = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}


def compiler_options(cfg: Config) -> Optional[dict]:
    """The options for ``cfg`` (``parallel.collective_pipelining``), or None for XLA's defaults."""
    options = dict(PIPELINED_COLLECTIVES) if cfg.parallel.collective_pipelining else {}
    return options or None
