"""DeepSeek-V3 multi-token-prediction weights: Hugging Face names <-> jaxtron's ``mtp`` parameters (docs/mtp.md).

DeepSeek-V3 checkpoints store MTP depth j (0-based, of D = config ``num_nextn_predict_layers``, jaxtron's
``model.mtp.num_layers``) as one more decoder layer after the L = ``num_hidden_layers`` main ones, HF layer
``L + j``; jaxtron stacks the D modules on a leading [D] axis under ``mtp`` (like ``layers``):

===================================================  =========================  ====================
Hugging Face (i = L + j)                             jaxtron (pure dict path)   HF tensor from ``x``
===================================================  =========================  ====================
model.layers.{i}.enorm.weight [d]                    mtp.enorm.scale            x[j]
model.layers.{i}.hnorm.weight [d]                    mtp.hnorm.scale            x[j]
model.layers.{i}.eh_proj.weight [d, 2d]              mtp.eh_proj [2d, d]        x[j].T
model.layers.{i}.shared_head.norm.weight [d]         mtp.norm.scale             x[j]
model.layers.{i}.<decoder layer name>                mtp.block.<its path>       as for ``layers``
===================================================  =========================  ====================

``eh_proj``'s input is ``[enorm(embedding); hnorm(hidden)]``, the embedding first, as the checkpoint was trained.
The checkpoint also holds ``model.layers.{i}.embed_tokens.weight`` and ``model.layers.{i}.shared_head.head.weight``:
copies of the main model's embedding and LM head, which jaxtron shares (:func:`mtp_shared_copy_names`; an
importer skips them, an exporter may write the main model's tensors under them). transformers'
``DeepseekV3ForCausalLM`` ignores the MTP layers altogether.

The decoder layer's own rows are the caller's (the same as a main layer of the same kind: dense, or MoE with
per-expert tensors), passed in as ``block_rows``; this module only places them under ``mtp.block`` at the HF
layer indices L..L+D-1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, Iterable

import numpy as np

HF_DEPTH_KEY = "num_nextn_predict_layers"  # the HF config key of model.mtp.num_layers


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


def _same(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class MTPWeight:
    """One MTP weight: its HF name (``{i}``: the HF layer index; ``{j}``: the expert, with ``experts``), its
    jaxtron pure-dict path (leading [D] axis, then [experts] when ``experts``), ``to_hf`` (a *view* of one
    depth's (and expert's) jaxtron array in HF layout) and the HF layer index of each depth. The fields are
    those of :mod:`jaxtron.convert.hf.weights`' stacked layer specs."""
    hf_name: str
    path: tuple[str, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    layers: tuple[int, ...]
    experts: int = 0

    def hf_names(self) -> list[str]:
        """One name per depth, or per depth and expert (depth-major)."""
        if self.experts:
            return [self.hf_name.format(i=i, j=e) for i in self.layers for e in range(self.experts)]
        return [self.hf_name.format(i=i) for i in self.layers]

    def per_tensor(self, arr: np.ndarray) -> list[np.ndarray]:
        """The (views of) per-HF-tensor slices of the stacked jaxtron array, in :meth:`hf_names` order."""
        if self.experts:
            return [arr[d, e] for d in range(arr.shape[0]) for e in range(self.experts)]
        return [arr[d] for d in range(arr.shape[0])]


def mtp_layer_ids(num_hidden_layers: int, depth: int) -> tuple[int, ...]:
    """The HF layer index of each MTP depth: L .. L + D - 1."""
    return tuple(range(num_hidden_layers, num_hidden_layers + depth))


def mtp_weights(num_hidden_layers: int, depth: int,
                block_rows: Iterable[tuple[str, tuple[str, ...], Callable, int]]) -> list[MTPWeight]:
    """Every MTP weight of a model with ``num_hidden_layers`` main layers and ``depth`` MTP modules, in HF order
    (the module's own weights, then its decoder layer's). ``block_rows``: one decoder layer of the kind of the
    model's last layer, as ``(HF name inside the layer, e.g. 'self_attn.q_proj.weight', jaxtron path inside a
    DecoderBlock, e.g. ('attention', 'wq'), to_hf, experts)`` with experts 0 for a tensor that is not per
    expert."""
    ids = mtp_layer_ids(num_hidden_layers, depth)
    if not ids:
        return []
    own = [("enorm.weight", ("enorm", "scale"), _same), ("hnorm.weight", ("hnorm", "scale"), _same),
           ("eh_proj.weight", ("eh_proj",), _transpose), ("shared_head.norm.weight", ("norm", "scale"), _same)]
    out = [MTPWeight(f"model.layers.{{i}}.{name}", ("mtp",) + path, fn, ids) for name, path, fn in own]
    for name, path, fn, experts in block_rows:
        out.append(MTPWeight(f"model.layers.{{i}}.{name}", ("mtp", "block") + tuple(path), fn, ids, experts))
    return out


def mtp_shared_copy_names(num_hidden_layers: int, depth: int) -> list[str]:
    """The HF names of the MTP layers' copies of the embedding and the LM head (shared in jaxtron)."""
    return [f"model.layers.{i}.{name}" for i in mtp_layer_ids(num_hidden_layers, depth)
            for name in ("embed_tokens.weight", "shared_head.head.weight")]


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            raise ValueError(f"MTP weights: missing jaxtron parameter {'.'.join(path)}")
        tree = tree[key]
    return tree


def mtp_to_hf(params: Mapping, weights: list[MTPWeight]) -> dict[str, np.ndarray]:
    """HF tensors (views) of the MTP weights of a jaxtron pure param dict."""
    out = {}
    for w in weights:
        arr = np.asarray(_get(params, w.path))
        if arr.shape[0] != len(w.layers):
            raise ValueError(f"MTP weights: {'.'.join(w.path)} has shape {arr.shape}; expected a leading MTP "
                             f"depth axis of {len(w.layers)}")
        for name, part in zip(w.hf_names(), w.per_tensor(arr)):
            out[name] = w.to_hf(part)
    return out


def mtp_from_hf(tensors: Mapping, weights: list[MTPWeight], shapes: Mapping, dtype) -> dict[tuple[str, ...],
                                                                                            np.ndarray]:
    """jaxtron path -> stacked numpy array (``dtype``) of every MTP weight, each HF tensor copied straight into a
    view of its slot. ``shapes``: the model's pure dict of abstract leaves (anything with ``.shape``). Raises
    ValueError naming the tensor when one is missing or of the wrong shape."""
    out = {}
    for w in weights:
        arr = np.empty(tuple(_get(shapes, w.path).shape), dtype)
        for name, target in zip(w.hf_names(), w.per_tensor(arr)):
            if name not in tensors:
                raise ValueError(f"missing tensor {name} (for jaxtron {'.'.join(w.path)})")
            view = w.to_hf(target)
            src = tensors[name]
            if tuple(src.shape) != view.shape:
                raise ValueError(f"tensor {name} has shape {tuple(src.shape)}; expected {view.shape} from the config")
            view[...] = src
        out[w.path] = arr
    return out
