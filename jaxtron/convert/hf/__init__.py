"""Hugging Face <-> jaxtron: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and ``DeepseekV3ForCausalLM`` folders (config.json + safetensors).

    cfg, model = jaxtron.convert.hf.load("path/to/Llama-3.1-8B", dtype="float32")
    jaxtron.convert.hf.save(model, "out/hf")          # AutoModelForCausalLM.from_pretrained("out/hf") loads it

The package: :mod:`.config` maps config.json onto a :class:`~jaxtron.config.ModelConfig` and back
(:func:`config_from_hf`, :func:`config_to_hf`), :mod:`.weights` maps the tensors (:func:`params_from_hf`,
:func:`params_to_hf`, with the table of how each Hugging Face tensor maps onto a jaxtron parameter), :mod:`.moe`
the experts' names, :mod:`.files` reads and writes the safetensors files, :mod:`.tokenizer` carries the
tokenizer across a conversion. :func:`load` and :func:`save` below put them together."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.convert.hf import files
from jaxtron.convert.hf.config import (ARCHITECTURES, CONFIG_NAME, MODEL_TYPES, config_from_hf, config_to_hf,
                                      read_config, rope_interleaved)
from jaxtron.convert.hf.files import INDEX_NAME, WEIGHTS_NAME, SafetensorsFiles
from jaxtron.convert.hf.weights import fp32_names, params_from_hf, params_to_hf
from jaxtron.convert.model_tree import abstract_model, model_from_params
from jaxtron.model.llama import Llama
from jaxtron.model.routing import ExpertBias

__all__ = ["ARCHITECTURES", "CONFIG_NAME", "INDEX_NAME", "MODEL_TYPES", "WEIGHTS_NAME", "SafetensorsFiles",
           "config_from_hf", "config_to_hf", "folder_config", "load", "params_from_hf", "params_to_hf", "read_config",
           "rope_interleaved", "save"]


def load(hf_dir: str, dtype: Optional[str] = None, param_dtype: Optional[str] = None
         ) -> tuple[ModelConfig, Llama]:
    """Load a Hugging Face folder of one of :data:`ARCHITECTURES`: returns ``(ModelConfig, Llama)``.

    ``dtype`` overrides the compute dtype (``ModelConfig.dtype``) and ``param_dtype`` the dtype the weights
    are kept in (default float32); ``load(dir, dtype="float32")`` gives an fp32 model.
    The model is built abstractly (``nnx.eval_shape``) and the checkpoint's arrays are merged in, so no
    random weights are allocated. Raises ValueError naming the key/tensor and file on any mismatch.
    A DeepSeek-V3 folder without MTP tensors loads without MTP (:func:`folder_config`)."""
    hf, config_path = read_config(hf_dir)
    tensors = SafetensorsFiles(hf_dir)
    cfg = folder_config(hf, tensors, source=config_path)
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v is not None}
    for k, v in overrides.items():
        overrides[k] = v if v == "auto" else jnp.dtype(v).name
    cfg = dataclasses.replace(cfg, **overrides)
    graphdef, abstract = abstract_model(cfg)
    params = params_from_hf(cfg, tensors, abstract, convert=jnp.asarray,
                            rope_interleave=rope_interleaved(hf))
    return cfg, model_from_params(cfg, params, graphdef, abstract)


def folder_config(hf_config: Mapping, tensors: Mapping, source: str = CONFIG_NAME) -> ModelConfig:
    """:func:`config_from_hf` of a folder whose tensors are ``tensors``: a DeepSeek-V3 config announces
    ``num_nextn_predict_layers`` MTP modules that transformers' own ``save_pretrained`` does not write, so
    without their tensors (HF layer ``num_hidden_layers``) the model has no MTP."""
    cfg = config_from_hf(hf_config, source=source)
    if cfg.mtp.num_layers and not any(n.startswith(f"model.layers.{cfg.num_layers}.") for n in tensors):
        cfg = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, num_layers=0))
    return cfg



def save(model: Llama, hf_dir: str, max_shard_bytes: int = 5 * 2**30, *, dtype: Optional[str] = None,
         architecture: Optional[str] = None, max_position_embeddings: Optional[int] = None,
         extra_config: Optional[dict] = None) -> None:
    """Write ``model`` (a jaxtron :class:`Llama`) as a Hugging Face folder that
    ``transformers.AutoModelForCausalLM.from_pretrained(hf_dir)`` loads.

    Weights are stored in ``dtype`` (default: the model's ``param_dtype``); above ``max_shard_bytes`` they
    are split into ``model-0000k-of-0000n.safetensors`` with a ``model.safetensors.index.json``; DeepSeek-V3's
    router weights and biases stay float32 (:func:`jaxtron.convert.hf.weights.fp32_names`). Existing
    weight files of those names in ``hf_dir`` are replaced. ``extra_config`` is merged into config.json
    (e.g. ``bos_token_id``/``eos_token_id``). See :func:`config_to_hf` for the other args."""
    cfg: ModelConfig = model.cfg
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    hf_config = config_to_hf(cfg, architecture, max_position_embeddings=max_position_embeddings,
                             dtype=out_dtype.name)
    hf_config.update(extra_config or {})
    params = nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, ExpertBias)))  # DeepSeek's bias is no Param
    tensors = params_to_hf(cfg, params)
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, CONFIG_NAME), "w") as f:
        json.dump(hf_config, f, indent=2)
    files.write(tensors, hf_dir, max_shard_bytes, out_dtype, keep_fp32=fp32_names(cfg, tensors))
