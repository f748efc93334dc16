"""Checkpoint format conversion.

:mod:`jaxtron.convert.hf` reads and writes Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM``, ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` folders (config.json + safetensors)."""

from jaxtron.jax_startup import import_jax

import_jax()  # before this package imports JAX: quiet on a machine without a GPU

from jaxtron.convert.hf import load, save
from jaxtron.convert.hf.config import config_from_hf, config_to_hf
from jaxtron.convert.hf.weights import params_from_hf, params_to_hf

__all__ = ["config_from_hf", "config_to_hf", "load", "params_from_hf", "params_to_hf", "save"]
