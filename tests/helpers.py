"""Small shared pieces for tests: a tiny fp32 config and synthetic batches."""

from __future__ import annotations

import contextlib

import numpy as np

from jaxtron import config as config_lib

TINY = [
    "model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=8",
    "model.num_kv_heads=4", "model.intermediate_size=128", "model.dtype=float32", "data.seq_len=16",
    "train.global_batch_size=8", "optim.warmup_steps=1", "train.steps=3",
    "logging.progress=false", "logging.tensorboard=false",
]


def tiny_config(*overrides: str) -> config_lib.Config:
    return config_lib.load(None, TINY + list(overrides))


def synthetic_batch(cfg: config_lib.Config, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    b, s = cfg.train.global_batch_size, cfg.data.seq_len
    toks = rng.integers(0, cfg.model.vocab_size, size=(b, s + 1), dtype=np.int32)
    return {
        "inputs": toks[:, :-1], "targets": toks[:, 1:],
        "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
        "segment_ids": np.ones((b, s), np.int32), "loss_mask": np.ones((b, s), np.float32),
    }


def xla_gpu_plugin_version():
    """The installed jax-cuda12-plugin version (XLA:GPU compiles without a GPU need it to equal jax's)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Kernel tests: the accuracy criterion and lowering for cuda without a GPU
# ---------------------------------------------------------------------------------------------------------------

# Bound on rel_error(kernel, reference) per input dtype; see tests/test_kernels_flash_attention.py's docstring.
KERNEL_TOL = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 5e-4}


def rel_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norm, computed in float64)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    scale = np.linalg.norm(e)
    assert scale > 0, "relative error against an all-zero reference is undefined"
    return float(np.linalg.norm(a - e) / scale)


H100 = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def gpu_target(device_kind: str = H100):
    """Name the target GPU for Pallas Triton lowerings on a machine without a GPU.

    The Pallas Triton lowering needs the target GPU's compute capability. jax 0.10 falls back to sm_90 when no GPU
    is present; jax >= 0.11 raises "No supported GPU devices found, please specify an abstract GPU device using
    AbstractDevice" instead. Both accept the target as the abstract device of the current abstract mesh
    (`jax.sharding.use_abstract_mesh`), which this sets: a one-device mesh of `device_kind`.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=device)):
        yield


def lower_for_cuda(fn, *specs, device_kind: str = H100) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for the cuda platform without a GPU (see `gpu_target`)."""
    import jax

    with gpu_target(device_kind):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
