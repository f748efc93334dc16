"""The planner's compile target: abstract XLA:GPU devices of a GPU kind (or CPU devices, asked for by name),
the config as it compiles there (GPU-only kernels swapped for stand-ins), and the train step compiled for them."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import re
from typing import Optional, Sequence

import jax

from jaxtron.config import Config, gmm_impl
from jaxtron.plan.gpus import GpuSpec

INSTALL = 'pip install -e ".[plan]"'


class CompilerUnavailable(RuntimeError):
    """The XLA:GPU compiler cannot be used here (no matching ``jax-cuda12-plugin`` or ``jax-cuda13-plugin``, or no
    topology)."""


# The CUDA 12 plugin is what the plan extra installs (no CUDA libraries needed to compile); a GPU machine's jax
# may carry the CUDA 13 one instead, whose XLA:GPU compiles for the same targets.
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def cuda_plugin() -> tuple[str, Optional[str]]:
    """(package, version) of the installed CUDA plugin jaxlib would load (its release is jaxlib's), else of the
    first one installed, else ('jax-cuda12-plugin', None)."""
    found = []
    for name in CUDA_PLUGINS:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    for name, v in found:
        if release(v) == release(jaxlib_version()):
            return name, v
    return found[0] if found else (CUDA_PLUGINS[0], None)


def cuda_plugin_version() -> Optional[str]:
    return cuda_plugin()[1]


def release(version: str) -> tuple[int, ...]:
    """The dotted numeric release of a version string: '0.12.0.1' -> (0, 12, 0, 1), '0.10.2.dev1+cuda' -> (0, 10,
    2). The part jaxlib compares when it decides whether to load a plugin (jaxlib/plugin_support.py)."""
    m = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def jaxlib_version() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", None) or importlib.metadata.version("jaxlib")


def cuda_plugin_matches() -> bool:
    """Whether jaxlib will load the installed plugin: the same release as jaxlib (jax 0.12.0.1 ships jaxlib 0.12.0.1
    and needs plugin 0.12.0.1; 0.12.0 is refused, so the planner says so rather than fail later). Local and
    pre-release suffixes are not compared, as jaxlib does not compare them."""
    v = cuda_plugin_version()
    return v is not None and release(v) == release(jaxlib_version())


def topology_string(num_gpus: int, gpus_per_node: int) -> str:
    """``get_topology_desc`` takes 'slices x hosts x devices per host'."""
    if num_gpus <= gpus_per_node:
        return f"1x1x{num_gpus}"
    if num_gpus % gpus_per_node:
        raise ValueError(f"--num-gpus {num_gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
    return f"1x{num_gpus // gpus_per_node}x{gpus_per_node}"


def target_devices(gpu: GpuSpec, num_gpus: int, backend: str = "auto") -> tuple[list, str, list[str]]:
    """(devices, 'gpu' or 'cpu', notes). 'gpu' (and 'auto'): abstract XLA:GPU devices from the GPU's target
    config, or :class:`CompilerUnavailable` saying how to install the compiler; 'cpu': N CPU devices and a note
    that the memory figures are indicative only. There is no silent fallback to the CPU compiler."""
    if backend in ("auto", "gpu"):
        if not cuda_plugin_matches():
            name, v = cuda_plugin()[0], cuda_plugin_version()
            want = jaxlib_version()
            have = f"{name} {v} does not match jaxlib {want}" if v else "jax-cuda12-plugin is not installed"
            raise CompilerUnavailable(
                f"the planner needs the XLA:GPU compiler ({have}): install it with {INSTALL} (or pip install "
                f"jax-cuda12-plugin=={want} jax-cuda12-pjrt=={want}); --backend cpu gives "
                "indicative CPU-compiler figures instead")
        shape = topology_string(num_gpus, gpu.gpus_per_node)
        multi_node_xla_flags(num_gpus, gpu.gpus_per_node)
        try:
            from jax.experimental import topologies

            topo = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=gpu.target_config())
            return list(topo.devices), "gpu", []
        except Exception as err:  # noqa: BLE001 - one line
            raise CompilerUnavailable(
                f"XLA:GPU topology unavailable ({str(err).splitlines()[0][:200]}); is "
                "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before jax is imported? (python -m jaxtron.plan sets it)"
            ) from None
    notes = [f"compiled with the CPU compiler on {num_gpus} virtual devices (--backend cpu); memory "
             "figures are indicative only (CPU scheduling and fusion differ from XLA:GPU)"]
    cpus = jax.devices("cpu")
    if len(cpus) < num_gpus:
        raise RuntimeError(f"the CPU compiler needs {num_gpus} CPU devices, this process has {len(cpus)}: set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={num_gpus} before jax starts "
                           "(python -m jaxtron.plan does this)")
    return cpus[:num_gpus], "cpu", notes


def prepare_config(cfg: Config, backend: str) -> tuple[Config, list[str]]:
    """The config as it is compiled for the target: GPU-only kernels that cannot be compiled here swapped."""
    cfg = copy.deepcopy(cfg)
    notes = []
    m = cfg.model
    if m.dtype == "auto":
        m.dtype = "bfloat16"
    m.moe.gmm_impl = gmm_impl(m, gpu=backend == "gpu")  # what 'auto' takes on the compile's devices
    if backend == "gpu" and m.attention_impl == "cudnn":
        m.attention_impl = "pallas"
        notes.append("attention: cuDNN cannot be compiled without cuDNN libraries; planned with jaxtron's Pallas "
                     "flash attention (same O(seq) memory)")
    if backend == "cpu":
        if m.attention_impl != "xla":
            notes.append(f"attention: {m.attention_impl} -> xla for the CPU compile (materializes seq x seq "
                         "scores: activation memory is overestimated)")
            m.attention_impl = "xla"
        m.rope_impl = m.mlp_impl = "xla"
    return cfg, notes


# XLA:GPU rewrites large sorts (the MoE dispatch's argsort) into CUB radix sorts, whose scratch size it asks the
# CUDA runtime for at compile time; without CUDA libraries that fails, so the planner compiles XLA's own sort.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
SORT_NOTE = ("sorts compiled with XLA's sort kernel instead of CUB radix sort (CUB needs the CUDA runtime at "
             "compile time): the MoE dispatch's argsort scratch may differ slightly on the cluster")


# XLA:GPU of jax 0.12 crashes (an LLVM fatal error: the process ends with status 1 and no Python error) lowering
# its Triton one-shot all-reduce kernel for a small all-reduce whose group spans nodes (the MoE aux loss's scalar
# over fsdp 64); that kernel is an NVLink-only path, so a cluster runs NCCL there anyway. XLA reads the switch
# from XLA_FLAGS when it starts (a compile option does not reach that pass), so it is set before the first
# topology is made; XLA before 0.12 has no such kernel or flag. MaxText's compile does the same
# (scripts/peer_compile.py).
ONE_SHOT_ALL_REDUCE_OFF = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"


def multi_node_xla_flags(num_gpus: int, gpus_per_node: int) -> None:
    """Add :data:`ONE_SHOT_ALL_REDUCE_OFF` to XLA_FLAGS for a target of more than one node (jaxlib >= 0.12),
    unless the caller set the flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if num_gpus > gpus_per_node and release(jaxlib_version()) >= (0, 12) and \
            "xla_gpu_unsupported_use_all_reduce_one_shot_kernel" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {ONE_SHOT_ALL_REDUCE_OFF}".strip()


def compile_step(cfg: Config, devices: Sequence):
    """(compiled, abstract state spec, layout): the same program as ``jaxtron.train.aot``."""
    from jaxtron.train.aot import lower_train_step_with_spec

    lowered, spec, layout = lower_train_step_with_spec(cfg, list(devices))
    gpu = devices[0].platform in ("gpu", "cuda")
    return lowered.compile(compiler_options=GPU_COMPILER_OPTIONS if gpu else None), spec, layout
