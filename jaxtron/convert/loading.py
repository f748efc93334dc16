"""Loading a model to run it (generation, evaluation): a Hugging Face folder or a jaxtron checkpoint, as a
:class:`~jaxtron.model.Llama` on the default device (put it on a mesh with ``Layout.place``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxtron.convert.model_tree import model_from_params


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _host_friendly(cfg):
    """On CPU, run the xla reference kernels (cudnn cannot run there, pallas would be interpreted)."""
    if jax.default_backend() != "cpu":
        return cfg
    return dataclasses.replace(cfg, attention_impl="xla", rope_impl="xla", mlp_impl="xla", remat="none")


class Loaded(NamedTuple):
    """A model to run and what its checkpoint says about running it."""
    cfg: Any             # ModelConfig
    model: Any           # Llama
    kind: str            # "hf" or "jaxtron"
    meta: dict           # the checkpoint's meta (HF folders: {})
    directory: str       # the checkpoint directory (where its tokenizer copy lives) or the HF folder
    seq_len: Optional[int]        # the sequence length it was trained with (HF folders: None)
    max_positions: Optional[int]  # the longest sequence it is known to handle (None: unknown)


def load_model(path: str, dtype: Optional[str] = None):
    """(ModelConfig, Llama, kind) of a Hugging Face folder (has config.json: ``kind="hf"``) or a jaxtron
    checkpoint (training or weights-only, a checkpoint directory or one step directory: ``kind="jaxtron"``).
    ``dtype`` overrides the compute dtype. Raises ValueError/CheckpointError/ConfigError with one-line
    messages."""
    loaded = load_for_inference(path, dtype)
    return loaded.cfg, loaded.model, loaded.kind


def load_for_inference(path: str, dtype: Optional[str] = None) -> Loaded:
    """:func:`load_model` plus the checkpoint's meta, directory, training sequence length and maximum
    positions (meta ``max_positions``; else the training ``data.seq_len``; HF: ``max_position_embeddings``)."""
    from jaxtron.convert import hf

    if not os.path.exists(path):
        raise ValueError(f"--checkpoint: {os.path.abspath(path)} does not exist")
    if is_hf_folder(path):
        cfg, model = hf.load(path, dtype=dtype)  # HF configs always get the xla reference kernels
        hf_config, _ = hf.read_config(path)
        maxpos = hf_config.get("max_position_embeddings")
        return Loaded(cfg, model, "hf", {}, os.path.abspath(path), None, int(maxpos) if maxpos else None)
    from jaxtron.convert.checkpoint_io import read_checkpoint

    full_cfg, params, meta, where = read_checkpoint(path)
    cfg = full_cfg.model
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)
    cfg = _host_friendly(cfg)
    # an import records its HF max_position_embeddings; a checkpoint of an older jaxtron only its seq_len,
    # which for an import is the default config's and says nothing about the model (None: no limit known)
    maxpos = meta.get("max_positions") or (None if meta.get("source") == "hf" else full_cfg.data.seq_len)
    return Loaded(cfg, model_from_params(cfg, params), "jaxtron", meta, os.path.dirname(where),
                  full_cfg.data.seq_len, maxpos)
