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

DeepSeek-V3 (``DeepseekV3ForCausalLM``; jaxtron's Multi-head Latent Attention, ``model.mla``) replaces the
attention rows (d hidden, h heads, n/r/v the nope/rope/value head widths, c/q the kv/q latent widths):

=========================================================  ==========================  ========================
self_attn.q_a_proj.weight [q, d]                           attention.wq_a [d, q]       x[i].T
self_attn.q_a_layernorm.weight [q]                         attention.q_norm.scale      x[i]
self_attn.q_b_proj.weight [h*(n+r), q]  (q_proj [.., d])   attention.wq_b [q, h, n+r]  per head: n rows, r rows
self_attn.kv_a_proj_with_mqa.weight [c+r, d]               attention.wkv_a [d, c]      rows :c
                                                           attention.wk_rope [d, r]    rows c: (rope rows)
self_attn.kv_a_layernorm.weight [c]                        attention.kv_norm.scale     x[i]
self_attn.kv_b_proj.weight [h*(n+v), c]                    attention.wk_b [c, h, n]    per head: n rows,
                                                           attention.wv_b [c, h, v]    then v rows
self_attn.o_proj.weight [d, h*v]                           attention.wo [h, v, d]      x[i].reshape(h*v, d).T
=========================================================  ==========================  ========================

and its MoE layers use Qwen3-MoE's names plus ``mlp.gate.e_score_correction_bias [E]`` <->
``layers.mlp.expert_bias`` (the aux-free bias, model state but no Param; zeros are written for a model without
one) and ``mlp.shared_experts.{gate,up,down}_proj.weight`` <-> ``layers.mlp.shared.{w_gate,w_up,w_down}``. Its
multi-token prediction modules (``model.mtp``) are HF layers ``num_hidden_layers + j``: their own weights named by
:mod:`jaxtron.convert.hf.mtp`, their decoder layer mapped as a main layer of the model's last kind onto
``mtp.block``; export also writes the MTP layers' copies of the embedding and LM head, import skips them.

RoPE. jaxtron rotates halves (x_k with x_{k+r/2}), as Hugging Face's Llama family, so their q/k weights need no
permutation. DeepSeek's checkpoints rotate interleaved pairs (x_{2i} with x_{2i+1}; transformers'
``rope_interleave: true``, its default): the pair (2i, 2i+1) of a Hugging Face rope row block is jaxtron's rows
(i, i + r/2), on import and export (which writes ``rope_interleave: true``); with ``rope_interleave: false``
the rows map one to one.

Every mapping above is a reshape plus a transpose (and a slice of one HF tensor where it holds several jaxtron
weights), i.e. a *view*: :func:`params_to_hf` returns views of the jaxtron arrays (a new array only for an HF
tensor joined from several jaxtron weights, or holding interleaved rope rows), and :func:`params_from_hf` writes
each HF tensor straight into a view of the stacked jaxtron array, so neither direction holds more than one extra
copy of a weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.convert.hf import mtp
from jaxtron.convert.hf.moe import deepseek_v3_extra_names, layer_blocks, moe_weight_names
from jaxtron.convert.model_tree import abstract_model
from jaxtron.model.routing import BIAS_NAME

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
    # A piece of an HF tensor that holds several (or several pieces of) jaxtron weights: (the whole HF tensor's
    # per-layer shape, a function giving the view of that tensor which equals ``to_hf`` of this weight).
    piece: Optional[tuple[tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = None

    @property
    def stacked(self) -> bool:
        return bool(self.layers)


def _mla_rows(cfg: ModelConfig, rope_interleave: bool) -> list[tuple]:
    """DeepSeek-V3's attention rows (name, jaxtron path, to_hf, piece): see the module docstring."""
    m, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
    n, r, v, c, q = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
    q_in = q or d
    heads_of = lambda t, rows, width: np.reshape(t, (h, rows, width), copy=False)  # noqa: E731

    def rope_to_hf(x):
        """The rope columns of a jaxtron weight [in, (h,) r] as HF rows [(h,) r, in] in the checkpoint's order:
        interleaved, HF rows (i, half) of a [(h,) r/2, 2, in] view are jaxtron's columns (half, i)."""
        k = x.ndim
        if not rope_interleave:
            return np.transpose(x, tuple(range(1, k)) + (0,))
        halves = np.reshape(x, x.shape[:-1] + (2, r // 2), copy=False)
        return np.transpose(halves, tuple(range(1, k - 1)) + (k, k - 1, 0))

    def rope_rows(rows):
        """The view of HF rope rows [(h,) r, in] that :func:`rope_to_hf` gives."""
        if not rope_interleave:
            return rows
        return np.reshape(rows, rows.shape[:-2] + (r // 2, 2, rows.shape[-1]), copy=False)

    q_whole = (h * (n + r), q_in)
    q_name, q_key = ("self_attn.q_b_proj.weight", "wq_b") if q else ("self_attn.q_proj.weight", "wq")
    rows = []
    if q:
        rows += [("self_attn.q_a_proj.weight", ("attention", "wq_a"), _linear_in, None),
                 ("self_attn.q_a_layernorm.weight", ("attention", "q_norm", "scale"), _same, None)]
    rows += [
        (q_name, ("attention", q_key), lambda x: np.transpose(x[:, :, :n], (1, 2, 0)),
         (q_whole, lambda t: heads_of(t, n + r, q_in)[:, :n])),
        (q_name, ("attention", q_key), lambda x: rope_to_hf(x[:, :, n:]),
         (q_whole, lambda t: rope_rows(heads_of(t, n + r, q_in)[:, n:]))),
        ("self_attn.kv_a_proj_with_mqa.weight", ("attention", "wkv_a"), _linear_in, ((c + r, d), lambda t: t[:c])),
        ("self_attn.kv_a_proj_with_mqa.weight", ("attention", "wk_rope"), rope_to_hf,
         ((c + r, d), lambda t: rope_rows(t[c:]))),
        ("self_attn.kv_a_layernorm.weight", ("attention", "kv_norm", "scale"), _same, None),
        ("self_attn.kv_b_proj.weight", ("attention", "wk_b"), lambda x: np.transpose(x, (1, 2, 0)),
         ((h * (n + v), c), lambda t: heads_of(t, n + v, c)[:, :n])),
        ("self_attn.kv_b_proj.weight", ("attention", "wv_b"), lambda x: np.transpose(x, (1, 2, 0)),
         ((h * (n + v), c), lambda t: heads_of(t, n + v, c)[:, n:])),
        ("self_attn.o_proj.weight", ("attention", "wo"), _linear_out, None),
    ]
    return rows


def _attention_rows(cfg: ModelConfig, rope_interleave: bool) -> list[tuple]:
    """The attention rows of a decoder layer (name, jaxtron path, to_hf, piece), with its input norm."""
    layer = [("input_layernorm.weight", ("attn_norm", "scale"), _same, None)]
    if cfg.mla.kv_lora_rank:
        return layer + _mla_rows(cfg, rope_interleave)
    layer += [
        ("self_attn.q_proj.weight", ("attention", "wq"), _linear_in, None),
        ("self_attn.k_proj.weight", ("attention", "wk"), _linear_in, None),
        ("self_attn.v_proj.weight", ("attention", "wv"), _linear_in, None),
    ]
    if cfg.qkv_bias:
        layer += [
            ("self_attn.q_proj.bias", ("attention", "bq"), _flat, None),
            ("self_attn.k_proj.bias", ("attention", "bk"), _flat, None),
            ("self_attn.v_proj.bias", ("attention", "bv"), _flat, None),
        ]
    layer += [
        ("self_attn.o_proj.weight", ("attention", "wo"), _linear_out, None),
    ]
    if cfg.qk_norm:
        layer += [
            ("self_attn.q_norm.weight", ("attention", "q_norm", "scale"), _same, None),
            ("self_attn.k_norm.weight", ("attention", "k_norm", "scale"), _same, None),
        ]
    return layer


def _block_rows(cfg: ModelConfig, moe: bool, rope_interleave: bool) -> tuple[list[tuple], list[tuple]]:
    """One decoder layer's rows, names after ``model.layers.{i}.`` and paths inside the block: (name, path,
    to_hf, piece) for its own weights, and (name, path, to_hf) for the per-expert ones of an MoE layer."""
    rows = _attention_rows(cfg, rope_interleave) + [
        ("post_attention_layernorm.weight", ("mlp_norm", "scale"), _same, None)]
    if not moe:
        return rows + [
            ("mlp.gate_proj.weight", ("mlp", "w_gate"), _linear_in, None),
            ("mlp.up_proj.weight", ("mlp", "w_up"), _linear_in, None),
            ("mlp.down_proj.weight", ("mlp", "w_down"), _linear_out, None),
        ], []
    (router, key), experts = moe_weight_names(cfg)
    rows.append((router, ("mlp", key), _linear_in, None))
    if cfg.mla.kv_lora_rank:  # DeepSeek-V3: the router's aux-free bias and the shared experts
        (bias, bias_key), shared = deepseek_v3_extra_names()
        if cfg.moe.aux_free_bias:
            rows.append((bias, ("mlp", bias_key), _same, None))
        rows += [(name, ("mlp",) + path, _linear_out if out else _linear_in, None) for name, path, out in shared]
    return rows, [(name, ("mlp", key), _linear_out if out else _linear_in) for name, key, out in experts]


def _mtp_specs(cfg: ModelConfig, rope_interleave: bool) -> list[_Spec]:
    """DeepSeek-V3's MTP modules (HF layers L..L+D-1; names from :mod:`jaxtron.convert.hf.mtp`), their decoder
    block a layer of the model's last kind."""
    ids = mtp.mtp_layer_ids(cfg.num_layers, cfg.mtp.num_layers)
    if not ids:
        return []
    own = [_Spec(w.hf_name, w.path, w.to_hf, layers=w.layers) for w in mtp.mtp_weights(cfg.num_layers, len(ids), [])]
    rows, expert_rows = _block_rows(cfg, bool(cfg.moe.num_experts), rope_interleave)
    block = ("mtp", "block")
    return own + [_Spec(f"model.layers.{{i}}.{name}", block + path, fn, layers=ids, piece=piece)
                  for name, path, fn, piece in rows] + [
        _Spec(f"model.layers.{{i}}.{name}", block + path, fn, layers=ids, experts=cfg.moe.num_experts)
        for name, path, fn in expert_rows]


def _specs(cfg: ModelConfig, rope_interleave: bool = True) -> list[_Spec]:
    """Every weight of the model, in the order Hugging Face lists them (the pieces of one HF tensor, and of one
    jaxtron weight, next to each other). ``rope_interleave``: DeepSeek-V3's rope row order (module docstring)."""
    if cfg.mtp.num_layers and not cfg.mla.kv_lora_rank:
        raise ValueError(f"model.mtp.num_layers: {cfg.mtp.num_layers} MTP modules have Hugging Face names only in "
                         f"DeepseekV3ForCausalLM (a model with model.mla)")
    specs = [_Spec("model.embed_tokens.weight", ("embed",), _same)]
    for prefix, ids, moe in layer_blocks(cfg):
        rows, expert_rows = _block_rows(cfg, moe, rope_interleave)
        specs += [_Spec(f"model.layers.{{i}}.{name}", prefix + path, fn, layers=ids, piece=piece)
                  for name, path, fn, piece in rows]
        specs += [_Spec(f"model.layers.{{i}}.{name}", prefix + path, fn, layers=ids, experts=cfg.moe.num_experts)
                  for name, path, fn in expert_rows]
    specs += _mtp_specs(cfg, rope_interleave)
    specs.append(_Spec("model.norm.weight", ("final_norm", "scale"), _same))
    if not cfg.tie_embeddings:
        specs.append(_Spec("lm_head.weight", ("lm_head",), _linear_in))
    return specs


def _absent_biases(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3 tensors a model without the aux-free bias has no weight for: its MoE layers'
    ``e_score_correction_bias`` (export writes zeros, import ignores them), name -> shape."""
    if not (cfg.mla.kv_lora_rank and cfg.moe.num_experts) or cfg.moe.aux_free_bias:
        return {}
    (bias, _), _ = deepseek_v3_extra_names()
    ids = [i for _, ids, moe in layer_blocks(cfg) if moe for i in ids]
    ids += mtp.mtp_layer_ids(cfg.num_layers, cfg.mtp.num_layers)
    return {f"model.layers.{i}.{bias}": (cfg.moe.num_experts,) for i in ids}


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
    (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, plus the ``expert_bias`` leaves of a DeepSeek-V3 model
    with aux-free balancing).

    The arrays are numpy *views* of the (host copies of the) jaxtron weights, in their dtype and possibly
    non-contiguous (new arrays where an HF tensor joins several weights); :func:`save` makes each contiguous as
    it writes it. DeepSeek-V3's rope rows are written interleaved (``rope_interleave: true``)."""
    out: dict[str, np.ndarray] = {}
    for spec in _specs(cfg):
        arr = np.asarray(_tree_get(params, spec.path, "params_to_hf"))
        if spec.stacked:
            if arr.ndim == 0 or arr.shape[0] != len(spec.layers):
                raise ValueError(f"params_to_hf: {'.'.join(spec.path)} has shape {arr.shape}; expected a leading "
                                 f"layers axis of {len(spec.layers)}")
            pairs = zip(_hf_names(cfg, spec), _per_tensor(arr, spec))
        else:
            pairs = [(spec.hf_name, arr)]
        for name, part in pairs:
            if spec.piece is None:
                out[name] = spec.to_hf(part)
                continue
            whole_shape, view = spec.piece
            if name not in out:
                out[name] = np.empty(whole_shape, arr.dtype)
            view(out[name])[...] = spec.to_hf(part)
    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    out.update({name: np.zeros(shape, dtype) for name, shape in _absent_biases(cfg).items()})
    # the MTP layers' own copies of the embedding and the LM head, as DeepSeek's checkpoints hold them
    head = out["model.embed_tokens.weight"] if cfg.tie_embeddings else out["lm_head.weight"]
    for name in mtp.mtp_shared_copy_names(cfg.num_layers, cfg.mtp.num_layers):
        out[name] = out["model.embed_tokens.weight"] if name.endswith("embed_tokens.weight") else head
    return out


def fp32_names(cfg: ModelConfig, names: Iterable[str]) -> set[str]:
    """The tensors of ``names`` a checkpoint keeps in float32 whatever its dtype: DeepSeek-V3's routers (gate
    weight and aux-free bias), which transformers keeps in fp32 (``_keep_in_fp32_modules_strict``) because a
    rounded score or bias changes which experts a token picks."""
    if not cfg.mla.kv_lora_rank:
        return set()
    return {n for n in names if n.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))}


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


def _check_hf_tensors(cfg: ModelConfig, tensors: Mapping, shapes: dict, rope_interleave: bool) -> None:
    """Fail before reading any weight: every tensor the config needs is present with the right shape, and
    the checkpoint holds nothing the config does not account for."""
    used = set(_absent_biases(cfg))
    for spec in _specs(cfg, rope_interleave):
        leaf_shape = tuple(_tree_get(shapes, spec.path, "model").shape)
        if spec.piece is not None:  # the whole tensor's shape; the piece's own follows from the config
            expected = spec.piece[0]
        else:
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
    used.update(mtp.mtp_shared_copy_names(cfg.num_layers, cfg.mtp.num_layers))  # jaxtron shares the main ones
    extra = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:5]) + (f", ... ({len(extra)} in all)" if len(extra) > 5 else "")
        raise ValueError(f"{_where(tensors)}: unexpected tensor(s) the config does not account for: {shown}")


def _fill_from_hf(spec: _Spec, names: list[str], out: np.ndarray, tensors: Mapping) -> None:
    """Fill (the piece ``spec`` names of) the jaxtron array ``out`` from the HF tensors ``names`` (one per layer
    when stacked): each HF tensor (or its piece) is copied straight into a view of ``out``, so no temporaries
    pile up. Names and shapes were checked by :func:`_check_hf_tensors`."""
    targets = _per_tensor(out, spec)
    for name, target in zip(names, targets):
        src = tensors[name]
        if not jnp.issubdtype(src.dtype, jnp.floating):
            raise ValueError(f"{_where(tensors, name)}: tensor {name} has non-float dtype {src.dtype}")
        spec.to_hf(target)[...] = src if spec.piece is None else spec.piece[1](np.asarray(src))


def _iter_params_from_hf(cfg: ModelConfig, tensors: Mapping, abstract: nnx.State, rope_interleave: bool = True
                         ) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """(jaxtron path, numpy array in ``cfg.param_dtype``; the aux-free bias in its own dtype) for every weight,
    after checking names and shapes of the whole checkpoint."""
    shapes = nnx.to_pure_dict(abstract)
    _check_hf_tensors(cfg, tensors, shapes, rope_interleave)
    for name in _absent_biases(cfg):  # a model without the bias may drop zeros, never a bias that routes
        if name in tensors and np.any(np.asarray(tensors[name])):
            raise ValueError(f"{_where(tensors, name)}: tensor {name} is non-zero but model.moe.aux_free_bias is "
                             f"false (the model would pick other experts); set it true")
    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    by_path: dict[tuple[str, ...], list[_Spec]] = {}
    for spec in _specs(cfg, rope_interleave):  # a jaxtron weight may be filled from several HF pieces
        by_path.setdefault(spec.path, []).append(spec)
    for path, specs in by_path.items():
        leaf = _tree_get(shapes, path, "model")
        out = np.empty(tuple(leaf.shape), np.dtype(leaf.dtype) if path[-1] == BIAS_NAME else dtype)
        for spec in specs:
            _fill_from_hf(spec, _hf_names(cfg, spec), out, tensors)
        yield path, out


def params_from_hf(cfg: ModelConfig, tensors: Mapping, abstract: Optional[nnx.State] = None,
                   convert: Callable[[np.ndarray], Any] = lambda a: a, rope_interleave: bool = True) -> dict:
    """A jaxtron pure param dict (numpy arrays in ``cfg.param_dtype``, each passed through ``convert`` as it is
    read: ``jnp.asarray`` keeps one host copy of a weight at a time) from HF tensors (name -> array).
    ``abstract``: the model's abstract state, if the caller has it (:func:`abstract_model`).

    ``tensors`` may be any mapping, including a lazy one. ``rope_interleave``: the config.json key of a
    DeepSeek-V3 checkpoint (the order of its rope rows; ignored for other models). Raises ValueError naming the
    tensor for a missing tensor, a wrong shape, or a tensor the config does not account for."""
    params: dict = {}
    if abstract is None:
        _, abstract = abstract_model(cfg)
    for path, arr in _iter_params_from_hf(cfg, tensors, abstract, rope_interleave):
        _tree_set(params, path, convert(arr))
    return params
