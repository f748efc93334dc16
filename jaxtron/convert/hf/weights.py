"""Hugging Face tensors <-> jaxtron parameters: the weight mapping and its checks (the files: :mod:`.files`).

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

Qwen3 adds ``model.layers.{i}.self_attn.{q,k}_norm.weight [k]`` <-> ``layers.attention.{q,k}_norm.scale``
(``x[i]``), the per-head RMSNorm scales of ``model.qk_norm``.

An MoE model's MLP rows become, for expert ``j`` (transformers 5 fuses the experts in memory but still writes
and reads these per-expert names), in Mixtral (``MixtralForCausalLM``):

=====================================================  =====================  ===================
model.layers.{i}.block_sparse_moe.gate.weight [E, d]   layers.mlp.router      x[i].T
model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight  layers.mlp.w_gate    x[i, j].T
model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight  layers.mlp.w_up      x[i, j].T
model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight  layers.mlp.w_down    x[i, j].T
=====================================================  =====================  ===================

and in Qwen3-MoE (``Qwen3MoeForCausalLM``, with Qwen3's Q/K norms) ``mlp.gate.weight`` and
``mlp.experts.{j}.{gate,up,down}_proj.weight`` in their place. jaxtron stacks the decoder layers by kind
(``dense_layers``; ``layers``, or ``layers.dense_{s}`` and ``layers.moe`` with model.moe.layer_freq > 1): the
``x[i]`` above is then the scanned unit of that stack holding HF layer ``i`` (:func:`jaxtron.convert.hf.moe.layer_blocks`).

jaxtron's RoPE uses the same rotate-half convention as Hugging Face, so q/k weights need no permutation.
Every mapping above is a reshape plus a transpose, i.e. a *view*: :func:`params_to_hf` returns views of
the jaxtron arrays, and :func:`params_from_hf` writes each HF tensor straight into a view of the stacked
jaxtron array, so neither direction holds more than one extra copy of a weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.convert.hf.moe import layer_blocks, moe_weight_names
from jaxtron.convert.model_tree import abstract_model

# HF checkpoint tensors that carry no weights (buffers some old checkpoints saved).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
    """One weight: its HF name (``{i}`` = layer index when stacked), its jaxtron pure-dict path, and
    ``to_hf``: a function that returns a *view* of a (per-layer) jaxtron array in HF layout."""
    hf_name: str
    path: tuple[str, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    layers: tuple[int, ...] = ()  # stacked: the HF layer index of each entry of the leading axis
    experts: int = 0  # > 0: also one HF tensor per expert ({j}), a second stacked axis of that size

    @property
    def stacked(self) -> bool:
        return bool(self.layers)


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
    ]
    if cfg.qk_norm:
        layer += [
            ("self_attn.q_norm.weight", ("attention", "q_norm", "scale"), _same),
            ("self_attn.k_norm.weight", ("attention", "k_norm", "scale"), _same),
        ]
    layer += [
        ("post_attention_layernorm.weight", ("mlp_norm", "scale"), _same),
    ]
    dense = [
        ("mlp.gate_proj.weight", ("mlp", "w_gate"), _linear_in),
        ("mlp.up_proj.weight", ("mlp", "w_up"), _linear_in),
        ("mlp.down_proj.weight", ("mlp", "w_down"), _linear_out),
    ]
    for prefix, ids, moe in layer_blocks(cfg):
        rows = list(layer)
        expert_rows = []
        if moe:
            (router, key), experts = moe_weight_names(cfg)
            rows.append((router, ("mlp", key), _linear_in))
            expert_rows = [(name, ("mlp", key), _linear_out if out else _linear_in) for name, key, out in experts]
        else:
            rows += dense
        specs += [_Spec(f"model.layers.{{i}}.{name}", prefix + path, fn, layers=ids) for name, path, fn in rows]
        specs += [_Spec(f"model.layers.{{i}}.{name}", prefix + path, fn, layers=ids, experts=cfg.moe.num_experts)
                  for name, path, fn in expert_rows]
    specs.append(_Spec("model.norm.weight", ("final_norm", "scale"), _same))
    if not cfg.tie_embeddings:
        specs.append(_Spec("lm_head.weight", ("lm_head",), _linear_in))
    return specs


def _hf_names(cfg: ModelConfig, spec: _Spec) -> list[str]:
    """The HF names of a spec: one, one per layer, or one per layer and expert (layer-major)."""
    if spec.experts:
        return [spec.hf_name.format(i=i, j=j) for i in spec.layers for j in range(spec.experts)]
    return [spec.hf_name.format(i=i) for i in spec.layers] if spec.stacked else [spec.hf_name]


def _per_tensor(arr, spec: _Spec) -> list:
    """The (views of) per-HF-tensor slices of a jaxtron array, in :func:`_hf_names` order."""
    if spec.experts:
        return [arr[i, j] for i in range(arr.shape[0]) for j in range(spec.experts)]
    return [arr[i] for i in range(arr.shape[0])] if spec.stacked else [arr]


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


def params_to_hf(cfg: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """HF tensors (name -> array) from a jaxtron pure param dict
    (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``).

    The arrays are numpy *views* of the (host copies of the) jaxtron weights, in their dtype and possibly
    non-contiguous; :func:`save` makes each contiguous as it writes it."""
    out: dict[str, np.ndarray] = {}
    for spec in _specs(cfg):
        arr = np.asarray(_tree_get(params, spec.path, "params_to_hf"))
        if spec.stacked:
            if arr.ndim == 0 or arr.shape[0] != len(spec.layers):
                raise ValueError(f"params_to_hf: {'.'.join(spec.path)} has shape {arr.shape}; expected a leading "
                                 f"layers axis of {len(spec.layers)}")
            for name, part in zip(_hf_names(cfg, spec), _per_tensor(arr, spec)):
                out[name] = spec.to_hf(part)
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
        expected = _hf_shape(spec, leaf_shape[(2 if spec.experts else 1) if spec.stacked else 0:])
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
    targets = _per_tensor(out, spec)
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


def params_from_hf(cfg: ModelConfig, tensors: Mapping, abstract: Optional[nnx.State] = None,
                   convert: Callable[[np.ndarray], Any] = lambda a: a) -> dict:
    """A jaxtron pure param dict (numpy arrays in ``cfg.param_dtype``, each passed through ``convert`` as it is
    read: ``jnp.asarray`` keeps one host copy of a weight at a time) from HF tensors (name -> array).
    ``abstract``: the model's abstract state, if the caller has it (:func:`abstract_model`).

    ``tensors`` may be any mapping, including a lazy one. Raises ValueError naming the tensor for a missing
    tensor, a wrong shape, or a tensor the config does not account for."""
    params: dict = {}
    if abstract is None:
        _, abstract = abstract_model(cfg)
    for path, arr in _iter_params_from_hf(cfg, tensors, abstract):
        _tree_set(params, path, convert(arr))
    return params
