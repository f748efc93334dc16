"""Hugging Face <-> jaxtron: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` folders (config.json + safetensors).

    cfg, model = jaxtron.convert.hf.load("path/to/Llama-3.1-8B", dtype="float32")
    jaxtron.convert.hf.save(model, "out/hf")          # AutoModelForCausalLM.from_pretrained("out/hf") loads it

Weight layout. Hugging Face ``nn.Linear`` weights are ``[out, in]``; jaxtron keeps ``[in, ...out]`` with the
heads split out, and stacks every decoder-block weight on a leading ``[num_layers]`` axis:

=================================================  ==========================  ===========================
Hugging Face                                       jaxtron (pure dict path)    HF tensor from jaxtron ``x``
=================================================  ==========================  ===========================
model.embed_tokens.weight [V, d]                   embed [V, d]                x
lm_head.weight [V, d] (absent when tied)           lm_head [d, V]              x.T
model.norm.weight [d]                              final_norm.scale [d]        x
model.layers.{i}.input_layernorm.weight            layers.attn_norm.scale      x[i]
model.layers.{i}.post_attention_layernorm.weight   layers.mlp_norm.scale       x[i]
model.layers.{i}.self_attn.q_proj.weight [h*k, d]  layers.attention.wq         x[i].reshape(d, h*k).T
model.layers.{i}.self_attn.{k,v}_proj.weight       layers.attention.{wk,wv}    (same, kv heads)
model.layers.{i}.self_attn.o_proj.weight [d, h*k]  layers.attention.wo         x[i].reshape(h*k, d).T
model.layers.{i}.self_attn.{q,k,v}_proj.bias       layers.attention.b{q,k,v}   x[i].reshape(-1)  (Qwen2)
model.layers.{i}.mlp.{gate,up}_proj.weight [f, d]  layers.mlp.{w_gate,w_up}    x[i].T
model.layers.{i}.mlp.down_proj.weight [d, f]       layers.mlp.w_down           x[i].T
=================================================  ==========================  ===========================

jaxtron's RoPE uses the same rotate-half convention as Hugging Face, so q/k weights need no permutation.
Every mapping above is a reshape plus a transpose, i.e. a *view*: :func:`params_to_hf` returns views of
the jaxtron arrays, and :func:`params_from_hf` writes each HF tensor straight into a view of the stacked
jaxtron array, so neither direction holds more than one extra copy of a weight.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxtron.config import ModelConfig, RopeScalingConfig, head_dim

if TYPE_CHECKING:
    from jaxtron.model.llama import Llama

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors dtype strings that numpy itself cannot represent (read through ml_dtypes instead).
_ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
# HF checkpoint tensors that carry no weights (buffers some old checkpoints saved).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# ============================================================================================ config


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
    if rope_type != "llama3":
        raise ValueError(f"{source}: {key}.rope_type={rope_type!r} is not supported; jaxtron supports "
                         f"'default' and 'llama3'")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if params.get(name) is None:
            raise ValueError(f"{source}: {key}.{name} is missing (required by rope_type 'llama3')")
    return theta, RopeScalingConfig(
        type="llama3", factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))


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
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (jaxtron attention is full "
                         f"causal)")


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
    hd = hf.get("head_dim")
    if hd is None and hidden % heads:
        raise ValueError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                         f"and head_dim is not set")
    hd = int(hd) if hd is not None else hidden // heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not divisible by "
                         f"num_key_value_heads={kv_heads}")
    if hd % 2:
        raise ValueError(f"{source}: head_dim={hd} must be even for RoPE")
    return ModelConfig(
        vocab_size=int(_get(hf, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=int(_get(hf, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=None if hd * heads == hidden else hd,
        intermediate_size=int(_get(hf, "intermediate_size", source)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(_get(hf, "rms_norm_eps", source, 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )


def _default_architecture(cfg: ModelConfig, architecture: Optional[str]) -> str:
    arch = architecture or ("Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM")
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture: {arch!r} is not one of {sorted(ARCHITECTURES)}")
    if arch == "LlamaForCausalLM" and cfg.qkv_bias:
        raise ValueError("model.qkv_bias: LlamaForCausalLM has no Q/K/V-only bias; save as Qwen2ForCausalLM")
    if arch == "Qwen2ForCausalLM" and not cfg.qkv_bias:
        raise ValueError("model.qkv_bias: Qwen2ForCausalLM always has Q/K/V biases; set model.qkv_bias=true "
                         "or save as LlamaForCausalLM")
    return arch


def config_to_hf(cfg: ModelConfig, architecture: Optional[str] = None, *,
                 max_position_embeddings: Optional[int] = None, dtype: Optional[str] = None) -> dict:
    """The Hugging Face config.json dict for ``cfg``.

    ``architecture`` defaults to ``Qwen2ForCausalLM`` when ``cfg.qkv_bias`` else ``LlamaForCausalLM``.
    RoPE is written as transformers 5 reads it (``rope_parameters`` with ``rope_type`` and ``rope_theta``)
    and also as transformers 4 reads it (top-level ``rope_theta`` and ``rope_scaling``; transformers 5
    folds these into the same ``rope_parameters``). jaxtron has no position table, so
    ``max_position_embeddings`` (informational for default/llama3 RoPE) defaults to
    ``factor * original_max_position_embeddings`` for llama3 scaling, else 4096. ``dtype`` is the storage
    dtype written as ``dtype``/``torch_dtype`` (default: ``cfg.param_dtype``)."""
    arch = _default_architecture(cfg, architecture)
    rs = cfg.rope_scaling
    if rs.type not in ("none", "llama3"):
        raise ValueError(f"model.rope_scaling.type: {rs.type!r} cannot be written to a HF config")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    rope_scaling = None
    if rs.type == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": float(rs.factor),
                        "low_freq_factor": float(rs.low_freq_factor),
                        "high_freq_factor": float(rs.high_freq_factor),
                        "original_max_position_embeddings": int(rs.original_max_position_embeddings)}
        rope_parameters = {**rope_scaling, "rope_theta": float(cfg.rope_theta)}
    if max_position_embeddings is None:
        max_position_embeddings = (int(rs.factor * rs.original_max_position_embeddings)
                                   if rs.type == "llama3" else 4096)
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
    else:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return hf


# ============================================================================================ tensors


def _linear_in(x: np.ndarray) -> np.ndarray:
    """jaxtron [in, *out] -> HF Linear weight [prod(out), in]."""
    return np.reshape(x, (x.shape[0], -1), copy=False).T


def _linear_out(x: np.ndarray) -> np.ndarray:
    """jaxtron [*in, out] -> HF Linear weight [out, prod(in)]."""
    return np.reshape(x, (-1, x.shape[-1]), copy=False).T


def _flat(x: np.ndarray) -> np.ndarray:
    return np.reshape(x, (-1,), copy=False)


def _same(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One weight: its HF name (``{i}`` = layer index when ``stacked``), its jaxtron pure-dict path, and
    ``to_hf``: a function that returns a *view* of a (per-layer) jaxtron array in HF layout."""
    hf_name: str
    path: tuple[str, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    stacked: bool = False


def _specs(cfg: ModelConfig) -> list[_Spec]:
    """Every weight of the model, in the order Hugging Face lists them."""
    specs = [_Spec("model.embed_tokens.weight", ("embed",), _same)]
    layer = [
        ("input_layernorm.weight", ("attn_norm", "scale"), _same),
        ("self_attn.q_proj.weight", ("attention", "wq"), _linear_in),
        ("self_attn.k_proj.weight", ("attention", "wk"), _linear_in),
        ("self_attn.v_proj.weight", ("attention", "wv"), _linear_in),
    ]
    if cfg.qkv_bias:
        layer += [
            ("self_attn.q_proj.bias", ("attention", "bq"), _flat),
            ("self_attn.k_proj.bias", ("attention", "bk"), _flat),
            ("self_attn.v_proj.bias", ("attention", "bv"), _flat),
        ]
    layer += [
        ("self_attn.o_proj.weight", ("attention", "wo"), _linear_out),
        ("post_attention_layernorm.weight", ("mlp_norm", "scale"), _same),
        ("mlp.gate_proj.weight", ("mlp", "w_gate"), _linear_in),
        ("mlp.up_proj.weight", ("mlp", "w_up"), _linear_in),
        ("mlp.down_proj.weight", ("mlp", "w_down"), _linear_out),
    ]
    specs += [_Spec(f"model.layers.{{i}}.{name}", ("layers",) + path, fn, stacked=True)
              for name, path, fn in layer]
    specs.append(_Spec("model.norm.weight", ("final_norm", "scale"), _same))
    if not cfg.tie_embeddings:
        specs.append(_Spec("lm_head.weight", ("lm_head",), _linear_in))
    return specs


def _hf_names(cfg: ModelConfig, spec: _Spec) -> list[str]:
    return [spec.hf_name.format(i=i) for i in range(cfg.num_layers)] if spec.stacked else [spec.hf_name]


def _tree_get(tree: Mapping, path: tuple[str, ...], what: str) -> Any:
    node: Any = tree
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"{what}: missing jaxtron parameter {'.'.join(path[:depth + 1])}")
        node = node[key]
    return node


def _tree_set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and an abstract state (shapes and dtypes only; no weights are allocated)."""
    from jaxtron.model.llama import Llama

    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def params_to_hf(cfg: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """HF tensors (name -> array) from a jaxtron pure param dict
    (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``).

    The arrays are numpy *views* of the (host copies of the) jaxtron weights, in their dtype and possibly
    non-contiguous; :func:`save` makes each contiguous as it writes it."""
    out: dict[str, np.ndarray] = {}
    for spec in _specs(cfg):
        arr = np.asarray(_tree_get(params, spec.path, "params_to_hf"))
        if spec.stacked:
            if arr.ndim == 0 or arr.shape[0] != cfg.num_layers:
                raise ValueError(f"params_to_hf: {'.'.join(spec.path)} has shape {arr.shape}; expected a leading "
                                 f"layers axis of {cfg.num_layers}")
            for i, name in enumerate(_hf_names(cfg, spec)):
                out[name] = spec.to_hf(arr[i])
        else:
            out[spec.hf_name] = spec.to_hf(arr)
    return out


def _where(tensors: Mapping, name: Optional[str] = None) -> str:
    """The file a tensor comes from (or the checkpoint as a whole), for error messages."""
    if name is not None and hasattr(tensors, "file_of"):
        return tensors.file_of(name)
    return getattr(tensors, "source", "the HF tensors")


def _hf_shape(spec: _Spec, jax_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of one (per-layer) jaxtron array of ``jax_shape``, without allocating it."""
    return tuple(spec.to_hf(np.broadcast_to(np.zeros((), np.int8), jax_shape)).shape)


def _shape_of(tensors: Mapping, name: str) -> tuple[int, ...]:
    """A tensor's shape, from the file header when ``tensors`` can tell it without reading the data."""
    if hasattr(tensors, "shape_of"):
        return tuple(tensors.shape_of(name))
    return tuple(tensors[name].shape)


def _check_hf_tensors(cfg: ModelConfig, tensors: Mapping, shapes: dict) -> None:
    """Fail before reading any weight: every tensor the config needs is present with the right shape, and
    the checkpoint holds nothing the config does not account for."""
    used = set()
    for spec in _specs(cfg):
        leaf_shape = tuple(_tree_get(shapes, spec.path, "model").shape)
        expected = _hf_shape(spec, leaf_shape[1:] if spec.stacked else leaf_shape)
        for name in _hf_names(cfg, spec):
            used.add(name)
            if name not in tensors:
                raise ValueError(f"{_where(tensors)}: missing tensor {name} (for jaxtron "
                                 f"{'.'.join(spec.path)})")
            shape = _shape_of(tensors, name)
            if shape != expected:
                raise ValueError(f"{_where(tensors, name)}: tensor {name} has shape {shape}; expected "
                                 f"{expected} from the config")
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints still store a copy of the embedding
    extra = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:5]) + (f", ... ({len(extra)} in all)" if len(extra) > 5 else "")
        raise ValueError(f"{_where(tensors)}: unexpected tensor(s) the config does not account for: {shown}")


def _fill_from_hf(spec: _Spec, names: list[str], shape: tuple[int, ...], dtype: np.dtype,
                  tensors: Mapping) -> np.ndarray:
    """One jaxtron array of ``shape``/``dtype`` filled from the HF tensors ``names`` (one per layer when
    stacked): each HF tensor is copied straight into a view of the result, so no temporaries pile up.
    Names and shapes were checked by :func:`_check_hf_tensors`."""
    out = np.empty(shape, dtype)
    targets = [out[i] for i in range(len(names))] if spec.stacked else [out]
    for name, target in zip(names, targets):
        src = tensors[name]
        if not jnp.issubdtype(src.dtype, jnp.floating):
            raise ValueError(f"{_where(tensors, name)}: tensor {name} has non-float dtype {src.dtype}")
        spec.to_hf(target)[...] = src
    return out


def _iter_params_from_hf(cfg: ModelConfig, tensors: Mapping, abstract: nnx.State
                         ) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """(jaxtron path, numpy array in ``cfg.param_dtype``) for every weight, after checking names and
    shapes of the whole checkpoint."""
    shapes = nnx.to_pure_dict(abstract)
    _check_hf_tensors(cfg, tensors, shapes)
    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    for spec in _specs(cfg):
        leaf = _tree_get(shapes, spec.path, "model")
        yield spec.path, _fill_from_hf(spec, _hf_names(cfg, spec), tuple(leaf.shape), dtype, tensors)


def params_from_hf(cfg: ModelConfig, tensors: Mapping) -> dict:
    """A jaxtron pure param dict (numpy arrays in ``cfg.param_dtype``) from HF tensors (name -> array).

    ``tensors`` may be any mapping, including a lazy one. Raises ValueError naming the tensor for a missing
    tensor, a wrong shape, or a tensor the config does not account for."""
    params: dict = {}
    _, abstract = _abstract_model(cfg)
    for path, arr in _iter_params_from_hf(cfg, tensors, abstract):
        _tree_set(params, path, arr)
    return params


# ============================================================================================ files


class _SafetensorsFiles(Mapping):
    """Lazy name -> numpy array over a HF folder's ``model.safetensors`` or sharded
    ``model-*.safetensors`` + ``model.safetensors.index.json``. Tensors are read when indexed."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, INDEX_NAME)
        single = os.path.join(hf_dir, WEIGHTS_NAME)
        self._handles: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        if os.path.exists(index):
            self.source = index
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{index}: not a safetensors index ({err})") from None
            self._files = {name: os.path.join(hf_dir, fname) for name, fname in weight_map.items()}
            for path in set(self._files.values()):
                if not os.path.exists(path):
                    raise ValueError(f"{index}: shard {os.path.basename(path)} does not exist")
        elif os.path.exists(single):
            self.source = single
            self._open(single)
            self._files = dict.fromkeys(sorted(self._keys[single]), single)
        else:
            raise ValueError(f"{hf_dir}: neither {WEIGHTS_NAME} nor {INDEX_NAME} exists")

    def _open(self, path: str):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="np")
            self._keys[path] = set(self._handles[path].keys())
        return self._handles[path]

    def _header(self, path: str) -> tuple[int, dict]:
        if path not in self._headers:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        return self._headers[path]

    def file_of(self, name: str) -> str:
        return self._files.get(name, self.source)

    def _handle_for(self, name: str):
        path = self._files[name]
        handle = self._open(path)
        if name not in self._keys[path]:
            raise ValueError(f"{self.source}: tensor {name} is listed for {os.path.basename(path)} but that "
                             f"file does not hold it")
        return path, handle

    def shape_of(self, name: str) -> list[int]:
        """The tensor's shape from the file header (no data is read)."""
        return self._handle_for(name)[1].get_slice(name).get_shape()

    def __getitem__(self, name: str) -> np.ndarray:
        path, handle = self._handle_for(name)
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in _ML_DTYPES:
            return handle.get_tensor(name)
        # numpy has no bfloat16/float8: map the bytes through ml_dtypes (read-only, no copy).
        start, header = self._header(path)
        entry = header[name]
        begin, _ = entry["data_offsets"]
        return np.memmap(path, dtype=_ML_DTYPES[dtype], mode="r", offset=start + begin,
                         shape=tuple(entry["shape"]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files


def _read_config(hf_dir: str) -> tuple[dict, str]:
    path = os.path.join(hf_dir, CONFIG_NAME)
    try:
        with open(path) as f:
            return json.load(f), path
    except OSError as err:
        raise ValueError(f"{path}: cannot read the HF config ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from None


def load(hf_dir: str, dtype: Optional[str] = None, param_dtype: Optional[str] = None
         ) -> tuple[ModelConfig, Llama]:
    """Load a Hugging Face Llama/Qwen2 folder: returns ``(ModelConfig, Llama)``.

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


def _plan_shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int, itemsize: int) -> list[list[str]]:
    """Group tensor names (in order) into shards of at most ``max_shard_bytes``; a bigger tensor gets a
    shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in tensors.items():
        nbytes = math.prod(arr.shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _remove_old_weights(hf_dir: str) -> None:
    """Delete weight files an earlier save may have left (a stale index or shard would shadow new ones)."""
    for fname in os.listdir(hf_dir):
        if fname in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(fname):
            os.remove(os.path.join(hf_dir, fname))


def save(model: Llama, hf_dir: str, max_shard_bytes: int = 5 * 2**30, *, dtype: Optional[str] = None,
         architecture: Optional[str] = None, max_position_embeddings: Optional[int] = None) -> None:
    """Write ``model`` (a jaxtron :class:`Llama`) as a Hugging Face folder that
    ``transformers.AutoModelForCausalLM.from_pretrained(hf_dir)`` loads.

    Weights are stored in ``dtype`` (default: the model's ``param_dtype``); above ``max_shard_bytes`` they
    are split into ``model-0000k-of-0000n.safetensors`` with a ``model.safetensors.index.json``. Existing
    weight files of those names in ``hf_dir`` are replaced. See :func:`config_to_hf` for the other args."""
    cfg: ModelConfig = model.cfg
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    hf_config = config_to_hf(cfg, architecture, max_position_embeddings=max_position_embeddings,
                             dtype=out_dtype.name)
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
