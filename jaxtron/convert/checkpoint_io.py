"""Hugging Face folders <-> jaxtron checkpoints (the logic behind ``python -m jaxtron.convert``).

:func:`import_hf` writes a *weights-only* jaxtron checkpoint (step 0, items ``params`` + ``meta``) plus a full
jaxtron ``config.yaml`` next to it, so that fine-tuning starts with

    python -m jaxtron.train --config CKPT/config.yaml checkpoint.load_weights=CKPT train.output_dir=...

:func:`export_hf` reads any jaxtron checkpoint (weights-only, a training run's ``checkpoints`` directory, or
one step directory of it), takes the model config from the checkpoint's meta and writes a Hugging Face folder.
Errors are :class:`ValueError` / :class:`~jaxtron.config.ConfigError` /
:class:`~jaxtron.checkpoint.CheckpointError` with a one-line message that names the path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional

import yaml

from jaxtron import config as config_lib
from jaxtron.checkpoint import Checkpointer, resolve_weights_path
from jaxtron.convert import hf
from jaxtron.convert.hf import tokenizer as hf_tokenizer
from jaxtron.convert.model_tree import abstract_model, model_from_params
from jaxtron.data import tokenizer_record

CONFIG_YAML = "config.yaml"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '5GB' (10**9, as transformers reads it), '5GiB' (2**30), '500MB', '64KiB' or a plain number."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"--max-shard-size: cannot parse {text!r} (e.g. 5GB, 500MB, 2GiB, 1000000)")
    unit = (m.group(2) or "").lower()
    unit = unit[:-1] if unit.endswith("b") and unit != "b" else unit
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"--max-shard-size: must be > 0, got {text!r}")
    return size


# ============================================================================================ import


def import_hf(hf_dir: str, out: str, dtype: str = "float32") -> config_lib.Config:
    """Write the HF folder ``hf_dir`` as a weights-only jaxtron checkpoint in ``out`` (step 0) plus
    ``out/config.yaml``; the weights are stored in ``dtype`` (the config's ``model.param_dtype``)."""
    hf_dir = os.path.abspath(hf_dir)
    out = os.path.abspath(out)
    if not os.path.isdir(hf_dir):
        raise ValueError(f"--hf-dir: {hf_dir} is not a directory")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"--out: {out} is not empty (refusing to overwrite; choose a new directory)")
    hf_config, config_path = hf.read_config(hf_dir)
    tensors = hf.SafetensorsFiles(hf_dir)
    model_cfg = dataclasses.replace(hf.folder_config(hf_config, tensors, source=config_path), param_dtype=dtype)
    tok_rec = hf_tokenizer.record_from_folder(hf_dir, hf_config)
    cfg = dataclasses.replace(config_lib.Config(), model=model_cfg)
    params = hf.params_from_hf(model_cfg, tensors, rope_interleave=hf.rope_interleaved(hf_config))  # numpy
    ckpt = Checkpointer(out, keep=1, async_save=False)
    try:
        meta = {"source": "hf", "hf_dir": hf_dir}
        if tok_rec is not None:
            # the copy in the checkpoint is the tokenizer fine-tuning data must be prepared with: config.yaml
            # names it, so a run on other data stops with an error naming data.tokenizer and both tokenizers
            tok_rec = tokenizer_record.copy_into(out, tok_rec)
            cfg.data.tokenizer = os.path.join(out, tok_rec["copy"])
            meta["tokenizer"] = tok_rec
        if hf_config.get("max_position_embeddings"):
            meta["max_positions"] = int(hf_config["max_position_embeddings"])
        config_lib.validate(cfg)  # config.yaml must load back
        text = config_lib.to_yaml(cfg)
        ckpt.save_params(0, params, {**meta, "config": text})
    finally:
        ckpt.close()
    with open(os.path.join(out, CONFIG_YAML), "w") as f:
        f.write(text)
    return cfg


# ============================================================================================ export


def _config_from_meta(meta: dict, where: str) -> config_lib.Config:
    text = meta.get("config")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the checkpoint's meta has no 'config' (cannot tell the model's shape)")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: the config in the checkpoint's meta is not YAML "
                         f"({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: the config in the checkpoint's meta is not a mapping")
    try:
        return config_lib.from_dict(raw)
    except config_lib.ConfigError as err:
        raise ValueError(f"{where}: the config in the checkpoint's meta is invalid ({err})") from None


def _host_device():
    """The CPU device when the CPU backend is available (export needs host memory only), else device 0."""
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


def read_checkpoint(path: str) -> tuple[config_lib.Config, Any, dict, str]:
    """(config, params pure dict on one device, meta, step directory) of the checkpoint at ``path``."""
    import jax
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    if not os.path.exists(path):
        raise ValueError(f"--checkpoint: {os.path.abspath(path)} does not exist")
    directory, step = resolve_weights_path(path, "--checkpoint")
    ckpt = Checkpointer(directory, read_only=True)
    try:
        where = ckpt.step_dir(step)
        meta = ckpt.restore_meta(step)
        cfg = _config_from_meta(meta, where)
        _, abstract = abstract_model(cfg.model)
        sharding = SingleDeviceSharding(_host_device())
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                              nnx.to_pure_dict(abstract))
        params = ckpt.restore_params(step, target)
    finally:
        ckpt.close()
    return cfg, params, meta, where


def export_hf(path: str, out: str, dtype: Optional[str] = None, max_shard_bytes: int = 5 * 10**9) -> str:
    """Write the checkpoint at ``path`` as a Hugging Face folder ``out``; returns the step directory read."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} exists and is not a directory")
    cfg, params, meta, where = read_checkpoint(path)
    model = model_from_params(cfg.model, params)
    rec = meta.get("tokenizer")
    # the longest sequence the model is known for (an old import: unknown, config_to_hf's default)
    maxpos = meta.get("max_positions") or (None if meta.get("source") == "hf" else cfg.data.seq_len)
    hf.save(model, out, max_shard_bytes=max_shard_bytes, dtype=dtype, max_position_embeddings=maxpos,
            extra_config=hf_tokenizer.special_ids(rec))
    hf_tokenizer.write_to_folder(rec, os.path.dirname(where), out, where)
    return where
