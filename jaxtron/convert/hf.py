"""Hugging Face <-> jaxtron: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` folders (config.json + safetensors).

    cfg, model = jaxtron.convert.hf.load("path/to/Llama-3.1-8B", dtype="float32")
    jaxtron.convert.hf.save(model, "out/hf")          # AutoModelForCausalLM.from_pretrained("out/hf") loads it

The config mapping lives in :mod:`jaxtron.convert.hf_config` (:func:`config_from_hf`, :func:`config_to_hf`), the
weight mapping and the safetensors files in :mod:`jaxtron.convert.hf_weights` (:func:`params_from_hf`,
:func:`params_to_hf`, with the table of how each Hugging Face tensor maps onto a jaxtron parameter); this module
puts them together and re-exports their public names."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxtron.config import ModelConfig
from jaxtron.convert.hf_config import (ARCHITECTURES, CONFIG_NAME, MODEL_TYPES, _read_config,  # noqa: F401
                                       config_from_hf, config_to_hf)
from jaxtron.convert.hf_weights import (INDEX_NAME, WEIGHTS_NAME, _abstract_model, _iter_params_from_hf,  # noqa: F401
                                        _plan_shards, _remove_old_weights, _SafetensorsFiles, _tree_set,
                                        params_from_hf, params_to_hf)

if TYPE_CHECKING:
    from jaxtron.model.llama import Llama

__all__ = ["ARCHITECTURES", "CONFIG_NAME", "INDEX_NAME", "MODEL_TYPES", "WEIGHTS_NAME", "config_from_hf",
           "config_to_hf", "load", "params_from_hf", "params_to_hf", "save"]


def load(hf_dir: str, dtype: Optional[str] = None, param_dtype: Optional[str] = None
         ) -> tuple[ModelConfig, Llama]:
    """Load a Hugging Face Llama/Qwen2/Qwen3 folder: returns ``(ModelConfig, Llama)``.

    ``dtype`` overrides the compute dtype (``ModelConfig.dtype``) and ``param_dtype`` the dtype the weights
    are kept in (default float32); ``load(dir, dtype="float32")`` gives an fp32 model.
    The model is built abstractly (``nnx.eval_shape``) and the checkpoint's arrays are merged in, so no
    random weights are allocated. Raises ValueError naming the key/tensor and file on any mismatch."""
    hf, config_path = _read_config(hf_dir)
    cfg = config_from_hf(hf, source=config_path)
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v is not None}
    for k, v in overrides.items():
        overrides[k] = v if v == "auto" else jnp.dtype(v).name
    cfg = dataclasses.replace(cfg, **overrides)
    tensors = _SafetensorsFiles(hf_dir)
    graphdef, abstract = _abstract_model(cfg)
    params: dict = {}
    for path, arr in _iter_params_from_hf(cfg, tensors, abstract):
        _tree_set(params, path, jnp.asarray(arr))
    nnx.replace_by_pure_dict(abstract, params)
    return cfg, nnx.merge(graphdef, abstract)



def save(model: Llama, hf_dir: str, max_shard_bytes: int = 5 * 2**30, *, dtype: Optional[str] = None,
         architecture: Optional[str] = None, max_position_embeddings: Optional[int] = None,
         extra_config: Optional[dict] = None) -> None:
    """Write ``model`` (a jaxtron :class:`Llama`) as a Hugging Face folder that
    ``transformers.AutoModelForCausalLM.from_pretrained(hf_dir)`` loads.

    Weights are stored in ``dtype`` (default: the model's ``param_dtype``); above ``max_shard_bytes`` they
    are split into ``model-0000k-of-0000n.safetensors`` with a ``model.safetensors.index.json``. Existing
    weight files of those names in ``hf_dir`` are replaced. ``extra_config`` is merged into config.json
    (e.g. ``bos_token_id``/``eos_token_id``). See :func:`config_to_hf` for the other args."""
    cfg: ModelConfig = model.cfg
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    hf_config = config_to_hf(cfg, architecture, max_position_embeddings=max_position_embeddings,
                             dtype=out_dtype.name)
    hf_config.update(extra_config or {})
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = params_to_hf(cfg, params)
    shards = _plan_shards(tensors, max_shard_bytes, out_dtype.itemsize)

    os.makedirs(hf_dir, exist_ok=True)
    _remove_old_weights(hf_dir)
    with open(os.path.join(hf_dir, CONFIG_NAME), "w") as f:
        json.dump(hf_config, f, indent=2)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        chunk = {n: np.ascontiguousarray(tensors[n], dtype=out_dtype) for n in names}
        save_file(chunk, os.path.join(hf_dir, fname), metadata={"format": "pt"})
        total += sum(a.nbytes for a in chunk.values())
        weight_map.update(dict.fromkeys(names, fname))
        del chunk
    if len(shards) > 1:
        with open(os.path.join(hf_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
