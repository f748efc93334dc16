"""Hugging Face config.json <-> jaxtron :class:`~jaxtron.config.ModelConfig`: the supported architectures
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM``,
``Qwen3MoeForCausalLM``, ``DeepseekV3ForCausalLM``; the MoE keys in :mod:`jaxtron.convert.hf.moe`, DeepSeek-V3's
Multi-head Latent Attention and multi-token prediction keys here), RoPE (default, llama3 and
yarn scaling, in the transformers 4 and 5 spellings), the checks for options jaxtron's model does not implement,
and the reverse mapping."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Optional

import jax.numpy as jnp

from jaxtron.config import ModelConfig, RopeScalingConfig, head_dim
from jaxtron.config.model_schema import MLAConfig, MoEConfig, MTPConfig
from jaxtron.convert.hf.moe import (DEEPSEEK_V3, MIXTRAL, MOE_ARCHITECTURES, QWEN3_MOE, check_moe_export,
                                    check_moe_hf, moe_from_hf, moe_to_hf)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "DeepseekV3ForCausalLM": "deepseek_v3"}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}

CONFIG_NAME = "config.json"


def _get(hf: Mapping, key: str, source: str, default: Any = dataclasses.MISSING) -> Any:
    """``hf[key]``; a missing (or null) required key raises ValueError naming the key and the file."""
    value = hf.get(key)
    if value is None:
        if default is dataclasses.MISSING:
            raise ValueError(f"{source}: required key {key!r} is missing")
        return default
    return value


def _architecture(hf: Mapping, source: str) -> str:
    """The supported architecture name, from ``architectures`` (or ``model_type`` when that is absent)."""
    archs = hf.get("architectures")
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(f"{source}: architectures={list(archs)} is not supported; "
                             f"jaxtron converts {sorted(ARCHITECTURES)}")
        arch = archs[0]
    else:
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{source}: no 'architectures' and model_type={model_type!r} is not one of "
                             f"{sorted(MODEL_TYPES)}")
        arch = MODEL_TYPES[model_type]
    model_type = hf.get("model_type")
    if model_type is not None and model_type != ARCHITECTURES[arch]:
        raise ValueError(f"{source}: model_type={model_type!r} does not match architectures=[{arch!r}] "
                         f"(expected {ARCHITECTURES[arch]!r})")
    return arch


def _rope_from_hf(hf: Mapping, source: str) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) from either transformers 5's ``rope_parameters`` or the older
    ``rope_scaling`` + top-level ``rope_theta``. Like transformers 5, a non-empty ``rope_scaling`` wins, and
    a ``rope_theta`` inside the dict wins over the top-level one."""
    key, params = "rope_parameters", hf.get("rope_parameters")
    if hf.get("rope_scaling"):
        key, params = "rope_scaling", hf["rope_scaling"]
    params = dict(params or {})
    if params and not any(k in params for k in ("rope_type", "type", "rope_theta")) and all(
            isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{source}: {key} is nested per layer type ({sorted(params)}); jaxtron supports one "
                         f"RoPE for every layer")
    theta = float(params.get("rope_theta", _get(hf, "rope_theta", source, 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported (must be 1.0)")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return theta, RopeScalingConfig(type="none")
    if rope_type == "yarn":
        return theta, _yarn_from_hf(hf, params, key, source)
    if rope_type != "llama3":
        raise ValueError(f"{source}: {key}.rope_type={rope_type!r} is not supported; jaxtron supports "
                         f"'default', 'llama3' and 'yarn'")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if params.get(name) is None:
            raise ValueError(f"{source}: {key}.{name} is missing (required by rope_type 'llama3')")
    return theta, RopeScalingConfig(
        type="llama3", factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def _yarn_from_hf(hf: Mapping, params: Mapping, key: str, source: str) -> RopeScalingConfig:
    """YaRN's fields as transformers 5 reads them (``_compute_yarn_parameters`` and its config standardization):
    ``original_max_position_embeddings`` from the top level first (Phi-3's spelling), then the dict, then
    ``max_position_embeddings``; beta_fast/beta_slow 32/1 when absent or 0. An absent (or 0) mscale is kept as 0
    (not set), which matters only with mscale_all_dim: transformers then derives the cos/sin factor from factor
    alone. The options whose math jaxtron does not carry are refused."""
    if params.get("factor") is None:  # transformers would fall back to max_position_embeddings / original
        raise ValueError(f"{source}: {key}.factor is missing (required by rope_type 'yarn')")
    if params.get("attention_factor") is not None:
        raise ValueError(f"{source}: {key}.attention_factor={params['attention_factor']} is not supported (jaxtron "
                         f"derives the yarn cos/sin factor from factor, mscale and mscale_all_dim)")
    if params.get("truncate") is not None and not params["truncate"]:
        raise ValueError(f"{source}: {key}.truncate=false is not supported (jaxtron's yarn rounds the ramp "
                         f"bounds to whole channels, transformers' default)")
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or \
        _get(hf, "max_position_embeddings", source)
    return RopeScalingConfig(type="yarn", factor=float(params["factor"]),
                             original_max_position_embeddings=int(original),
                             beta_fast=float(params.get("beta_fast") or 32.0),
                             beta_slow=float(params.get("beta_slow") or 1.0),
                             mscale=float(params.get("mscale") or 0.0),
                             mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))


def _check_unsupported(hf: Mapping, arch: str, source: str) -> None:
    """Raise for HF options jaxtron's model does not implement."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported (jaxtron's MLP is SwiGLU: 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (jaxtron's MLP has no bias)")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for LlamaForCausalLM (it adds an "
                         f"o_proj bias; jaxtron has Q/K/V biases only, as in Qwen2)")
    if arch == "Qwen3ForCausalLM" and hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for Qwen3ForCausalLM (it adds Q/K/V "
                         f"and o_proj biases; jaxtron has no o_proj bias)")
    if arch == "MixtralForCausalLM" and hf.get("sliding_window"):
        raise ValueError(f"{source}: sliding_window={hf['sliding_window']} is not supported (jaxtron attention "
                         f"is full causal)")
    if arch == DEEPSEEK_V3 and hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for {DEEPSEEK_V3} (it adds q_a/kv_a/o_proj "
                         f"biases; jaxtron's MLA has none)")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (jaxtron attention is full "
                         f"causal)")
    check_moe_hf(hf, arch, source)


def config_from_hf(hf_config: Mapping, source: str = CONFIG_NAME) -> ModelConfig:
    """A jaxtron :class:`ModelConfig` from a Hugging Face config dict (the contents of config.json).

    Only the architecture is read; compute and parameter dtypes keep :class:`ModelConfig`'s defaults
    (fp32 master weights) -- the checkpoint's ``torch_dtype`` only says how the file stores them.
    ``source`` names the file in error messages. Raises ValueError naming the key for anything jaxtron's
    model cannot reproduce (other architectures, RoPE types, sliding windows, MLP/output biases)."""
    hf = dict(hf_config)
    arch = _architecture(hf, source)
    _check_unsupported(hf, arch, source)
    theta, scaling = _rope_from_hf(hf, source)
    hidden = int(_get(hf, "hidden_size", source))
    heads = int(_get(hf, "num_attention_heads", source))
    kv_heads = int(_get(hf, "num_key_value_heads", source, heads))
    mla, mtp = MLAConfig(), MTPConfig()
    if arch == DEEPSEEK_V3:
        mla, mtp = _mla_from_hf(hf, source)
        kv_heads = heads  # MLA has no key/value head count of its own; transformers' key_value heads are the heads
    hd = hf.get("head_dim")
    if arch == DEEPSEEK_V3:  # its head_dim is the rope width; MLA reads model.mla, model.head_dim only fills a gap
        hd = hidden // heads if hidden % heads == 0 else mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if hd is None and arch in ("Qwen3ForCausalLM", QWEN3_MOE):
        hd = 128  # transformers' Qwen3(Moe)Config default when config.json has no head_dim (not hidden // heads)
    if hd is None and hidden % heads:
        raise ValueError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                         f"and head_dim is not set")
    hd = int(hd) if hd is not None else hidden // heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not divisible by "
                         f"num_key_value_heads={kv_heads}")
    if hd % 2 and arch != DEEPSEEK_V3:  # MLA rotates qk_rope_head_dim (checked even) only
        raise ValueError(f"{source}: head_dim={hd} must be even for RoPE")
    layers = int(_get(hf, "num_hidden_layers", source))
    moe, ffn = MoEConfig(), None
    if arch in MOE_ARCHITECTURES:
        moe, ffn = moe_from_hf(hf, arch, layers, source)
    return ModelConfig(
        vocab_size=int(_get(hf, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=None if hd * heads == hidden else hd,
        intermediate_size=ffn if ffn is not None else int(_get(hf, "intermediate_size", source)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(_get(hf, "rms_norm_eps", source, 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", QWEN3_MOE),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        moe=moe,
        mla=mla,
        mtp=mtp,
    )


def _mla_from_hf(hf: Mapping, source: str) -> tuple[MLAConfig, MTPConfig]:
    """DeepSeek-V3's attention widths and MTP depth. A q_lora_rank of null (or 0) projects queries from the
    hidden state directly. ``num_nextn_predict_layers`` is the depth the config announces;
    :func:`jaxtron.convert.hf.folder_config` drops it when the checkpoint holds no MTP weights (transformers'
    ``save_pretrained`` writes none)."""
    rope = int(_get(hf, "qk_rope_head_dim", source))
    if rope % 2:
        raise ValueError(f"{source}: qk_rope_head_dim={rope} must be even for RoPE")
    mla = MLAConfig(kv_lora_rank=int(_get(hf, "kv_lora_rank", source)), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                    qk_nope_head_dim=int(_get(hf, "qk_nope_head_dim", source)), qk_rope_head_dim=rope,
                    v_head_dim=int(_get(hf, "v_head_dim", source)))
    if mla.kv_lora_rank <= 0:
        raise ValueError(f"{source}: kv_lora_rank={mla.kv_lora_rank} must be > 0")
    depth = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers"))
    return mla, MTPConfig(num_layers=int(depth or 0))


def _default_architecture(cfg: ModelConfig, architecture: Optional[str]) -> str:
    if cfg.mla.kv_lora_rank:  # Multi-head Latent Attention: only DeepSeek-V3 holds it
        arch = architecture or DEEPSEEK_V3
        if arch != DEEPSEEK_V3:
            raise ValueError(f"architecture: a model with model.mla saves as {DEEPSEEK_V3}, not {arch!r}")
        if not cfg.moe.num_experts:
            raise ValueError(f"model.moe.num_experts: {DEEPSEEK_V3} export needs MoE layers (a dense MLA model has "
                             f"no Hugging Face class here)")
        check_moe_export(cfg, arch)
        return arch
    if architecture == DEEPSEEK_V3:
        raise ValueError(f"model.mla.kv_lora_rank: {DEEPSEEK_V3} needs Multi-head Latent Attention (set it > 0)")
    if cfg.mtp.num_layers:
        raise ValueError(f"model.mtp.num_layers: {cfg.mtp.num_layers} multi-token prediction modules have a Hugging "
                         f"Face spelling only in {DEEPSEEK_V3} (with model.mla)")
    if cfg.moe.num_experts:  # Q/K norms: Qwen3-MoE, else Mixtral
        # DeepSeek-V3's routing (sigmoid scores, group-limited top-k, scaled weights, bias balancing) has no
        # spelling in Mixtral or Qwen3-MoE, and DeepseekV3ForCausalLM needs MLA: say that, not which Mixtral
        # field differs
        e, plain = cfg.moe, dict(score_func="softmax", n_group=1, routed_scaling_factor=1.0, aux_free_bias=False)
        deepseek = {k: getattr(e, k) for k, v in plain.items() if getattr(e, k) != v}
        if architecture is None and deepseek:
            shown = ({"num_shared_experts": e.num_shared_experts} if e.num_shared_experts else {}) | deepseek
            raise ValueError("model.moe: a DeepSeek-V3-style MoE (" + ", ".join(f"{k}={v}" for k, v in shown.items())
                             + f") saves as {DEEPSEEK_V3}, which needs Multi-head Latent Attention (model.mla)")
        arch = architecture or (QWEN3_MOE if cfg.qk_norm else MIXTRAL)
        if arch not in MOE_ARCHITECTURES:
            raise ValueError(f"architecture: an MoE model saves as one of {list(MOE_ARCHITECTURES)}, not {arch!r}")
        check_moe_export(cfg, arch)
        return arch
    arch = architecture or ("Qwen3ForCausalLM" if cfg.qk_norm else
                            "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM")
    if arch not in ARCHITECTURES or arch in MOE_ARCHITECTURES:
        raise ValueError(f"architecture: a dense model saves as one of "
                         f"{sorted(set(ARCHITECTURES) - set(MOE_ARCHITECTURES))}, not {arch!r}")
    if (arch == "Qwen3ForCausalLM") != cfg.qk_norm:
        raise ValueError(f"model.qk_norm: {arch} {'needs' if arch == 'Qwen3ForCausalLM' else 'has no'} Q/K "
                         f"norms; {'set model.qk_norm=true' if not cfg.qk_norm else 'save as Qwen3ForCausalLM'}")
    if arch == "Qwen3ForCausalLM" and cfg.qkv_bias:
        raise ValueError("model.qkv_bias: Qwen3ForCausalLM has no Q/K/V-only bias (its attention_bias also "
                         "adds an o_proj bias); set model.qkv_bias=false")
    if arch == "LlamaForCausalLM" and cfg.qkv_bias:
        raise ValueError("model.qkv_bias: LlamaForCausalLM has no Q/K/V-only bias; save as Qwen2ForCausalLM")
    if arch == "Qwen2ForCausalLM" and not cfg.qkv_bias:
        raise ValueError("model.qkv_bias: Qwen2ForCausalLM always has Q/K/V biases; set model.qkv_bias=true "
                         "or save as LlamaForCausalLM")
    return arch


def config_to_hf(cfg: ModelConfig, architecture: Optional[str] = None, *,
                 max_position_embeddings: Optional[int] = None, dtype: Optional[str] = None) -> dict:
    """The Hugging Face config.json dict for ``cfg``.

    ``architecture`` defaults to ``Qwen3ForCausalLM`` when ``cfg.qk_norm``, ``Qwen2ForCausalLM`` when
    ``cfg.qkv_bias``, else ``LlamaForCausalLM``; for an MoE model, ``Qwen3MoeForCausalLM`` when
    ``cfg.qk_norm``, else ``MixtralForCausalLM``; with ``cfg.mla`` (an MoE model), ``DeepseekV3ForCausalLM``, its
    rope rows interleaved as DeepSeek's checkpoints are (``rope_interleave: true``; see
    :mod:`jaxtron.convert.hf.weights`) and ``num_nextn_predict_layers`` = ``cfg.mtp.num_layers``.
    RoPE is written as transformers 5 reads it (``rope_parameters`` with ``rope_type`` and ``rope_theta``)
    and also as transformers 4 reads it (top-level ``rope_theta`` and ``rope_scaling``; transformers 5
    folds these into the same ``rope_parameters``). jaxtron has no position table, so
    ``max_position_embeddings`` (informational: transformers' yarn reads it only when ``factor`` is absent, which
    jaxtron always writes) defaults to ``factor * original_max_position_embeddings`` for llama3 and yarn
    scaling, else 4096. ``dtype`` is the storage dtype written as ``dtype``/``torch_dtype`` (default:
    ``cfg.param_dtype``)."""
    arch = _default_architecture(cfg, architecture)
    rs = cfg.rope_scaling
    if rs.type not in ("none", "llama3", "yarn"):
        raise ValueError(f"model.rope_scaling.type: {rs.type!r} cannot be written to a HF config")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    rope_scaling = None
    if rs.type == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": float(rs.factor),
                        "low_freq_factor": float(rs.low_freq_factor),
                        "high_freq_factor": float(rs.high_freq_factor),
                        "original_max_position_embeddings": int(rs.original_max_position_embeddings)}
    elif rs.type == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": float(rs.factor),
                        "original_max_position_embeddings": int(rs.original_max_position_embeddings),
                        "beta_fast": float(rs.beta_fast), "beta_slow": float(rs.beta_slow)}
        # 0 is "not set" in jaxtron and falsy in transformers: written only when set, read back as 0 when absent
        rope_scaling.update({k: float(getattr(rs, k)) for k in ("mscale", "mscale_all_dim") if getattr(rs, k)})
    if rope_scaling is not None:
        rope_parameters = {**rope_scaling, "rope_theta": float(cfg.rope_theta)}
    if max_position_embeddings is None:
        max_position_embeddings = (int(rs.factor * rs.original_max_position_embeddings)
                                   if rs.type in ("llama3", "yarn") else 4096)
    dtype = str(jnp.dtype(dtype or cfg.param_dtype))
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": head_dim(cfg),
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position_embeddings),
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if arch == "LlamaForCausalLM":
        hf.update(attention_bias=False, mlp_bias=False)
    elif arch == DEEPSEEK_V3:
        m = cfg.mla
        hf.update(moe_to_hf(cfg, arch), num_key_value_heads=cfg.num_heads, head_dim=m.qk_rope_head_dim,
                  kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or None,
                  qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                  v_head_dim=m.v_head_dim, rope_interleave=True, attention_bias=False,
                  num_nextn_predict_layers=cfg.mtp.num_layers)
    elif arch in MOE_ARCHITECTURES:
        hf.update(moe_to_hf(cfg, arch))
    else:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    if arch == "Qwen3ForCausalLM":
        hf.update(attention_bias=False)
    return hf

def rope_interleaved(hf: Mapping) -> bool:
    """Whether a DeepSeek-V3 checkpoint's rope rows are in interleaved pairs (``rope_interleave``, transformers'
    default true); :func:`jaxtron.convert.hf.params_from_hf` takes it."""
    return bool(hf.get("rope_interleave", True))


def read_config(hf_dir: str) -> tuple[dict, str]:
    """(config.json of the Hugging Face folder ``hf_dir`` as a dict, its path); ValueError naming the file."""
    path = os.path.join(hf_dir, CONFIG_NAME)
    try:
        with open(path) as f:
            return json.load(f), path
    except OSError as err:
        raise ValueError(f"{path}: cannot read the HF config ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from None

