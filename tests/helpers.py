"""Small shared pieces for tests: a tiny fp32 config and synthetic batches."""

from __future__ import annotations

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
