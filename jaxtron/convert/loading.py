"""Loading a model to run it (generation, evaluation): a Hugging Face folder or a jaxtron checkpoint, as a
:class:`~jaxtron.model.Llama` on the default device (put it on a mesh with ``Layout.place``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _host_friendly(cfg):
    """On CPU, run the xla reference kernels (cudnn cannot run there, pallas would be interpreted)."""
    if jax.default_backend() != "cpu":
        return cfg
    return dataclasses.replace(cfg, attention_impl="xla", rope_impl="xla", mlp_impl="xla", remat="none")


def load_model(path: str, dtype: Optional[str] = None):
    """(ModelConfig, Llama, kind) of a Hugging Face folder (has config.json: ``kind="hf"``) or a jaxtron
    checkpoint (training or weights-only, a checkpoint directory or one step directory: ``kind="jaxtron"``).
    ``dtype`` overrides the compute dtype. Raises ValueError/CheckpointError/ConfigError with one-line
    messages."""
    from jaxtron.convert import hf

    if not os.path.exists(path):
        raise ValueError(f"--checkpoint: {os.path.abspath(path)} does not exist")
    if is_hf_folder(path):
        cfg, model = hf.load(path, dtype=dtype)  # HF configs always get the xla reference kernels
        return cfg, model, "hf"
    from jaxtron.convert.checkpoint_io import read_checkpoint

    full_cfg, params, _, _ = read_checkpoint(path)
    cfg = full_cfg.model
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)
    cfg = _host_friendly(cfg)
    graphdef, abstract = hf._abstract_model(cfg)
    nnx.replace_by_pure_dict(abstract, params)
    return cfg, nnx.merge(graphdef, abstract), "jaxtron"
