"""Plan a cluster run without the cluster: ``python -m jaxtron.plan``.

Compiles the real train step ahead of time for N GPUs of a given kind (nothing is allocated) and reports per
device memory (the compiler's own memory analysis), FLOPs, the bytes each kind of collective moves (read from
the optimized HLO) and a roofline prediction of step time and MFU. With ``--search`` it tries layouts.

The XLA:GPU compiler is used, from ``jax-cuda12-plugin`` of the installed jax version (``pip install -e
".[plan]"``; no GPU is needed: the target is described by ``gpus/<name>.txtpb``); without it the planner stops
with :class:`CompilerUnavailable`. ``backend="cpu"`` compiles the same program with the CPU compiler on N
virtual CPU devices instead, whose memory figures are only indicative (a different scheduler and fusion).
"""

from jaxtron.jax_startup import import_jax

import_jax()  # before this package imports JAX: quiet on a machine without a GPU

from jaxtron.plan.gpus import GPUS, GpuSpec, get_gpu
from jaxtron.plan.report import plan
from jaxtron.plan.search import candidate_configs, search
from jaxtron.plan.target import CompilerUnavailable, prepare_config, target_devices

__all__ = ["plan", "search", "candidate_configs", "target_devices", "CompilerUnavailable", "prepare_config",
           "GpuSpec", "GPUS", "get_gpu"]
