"""Muon (``optim.name=muon``): momentum orthogonalised by a Newton-Schulz iteration for the hidden weight
matrices, AdamW for the rest.

Which leaves: a weight whose logical axes hold ``embed`` and at least one of the hidden axes (``heads``,
``kv_heads``, ``head_dim``, ``mlp``) is a matrix ``[fan_in, fan_out]``: the axes on ``embed``'s side of the
matmul form fan_in or fan_out (``wq [embed, heads, head_dim]`` is ``embed -> heads*head_dim``, ``wo`` and
``w_down`` the other way). Every other axis (the scanned stacks' ``layers``, ``dense_layers``, the MoE experts'
``experts``) is a batch axis: each layer, and each expert, is orthogonalised on its own. Embeddings and the
LM head (``vocab``), the router, the shared-expert gate, norms and biases take the AdamW of
:mod:`jaxtron.train.optimizer` (same betas, eps, no decay on norms and biases).

The momentum and the iteration are optax's (``optax.contrib.scale_by_muon``: Nesterov momentum ``beta``, then
``ns_steps`` quintic Newton-Schulz steps with coefficients (3.4445, -4.7750, 2.0315) on the Frobenius-normalised
matrix, transposed so that it is wide). The update is then scaled by shape, then weight decay and the learning
rate are applied as for AdamW. Scale (``optim.muon_rms``): Moonshot's RMS matching (Liu et al. 2025, "Muon is
Scalable for LLM Training", arXiv:2502.16982): ``0.2 * sqrt(max(fan_in, fan_out))`` makes the update's RMS
about AdamW's, so AdamW's learning rate and weight decay carry over; ``muon_rms=0`` uses Keller Jordan's
``sqrt(max(1, fan_out / fan_in))`` (github.com/KellerJordan/Muon), which wants its own, larger, learning rate.

Sharded parameters: nothing is gathered by hand. The update runs inside the jitted train step on the momentum as
it is sharded (like the parameter: FSDP on one of ``embed``/``mlp``, tensor parallelism on ``heads``/``mlp``,
the stage axis on ``layers``, the expert axis on ``experts``), and XLA's SPMD partitioner splits the
iteration's matmuls. The batch axes (layers, experts) stay split: each stage or expert rank orthogonalises only
its own matrices. Over a matrix split on fsdp and tensor, each Newton-Schulz step of each weight costs (counted
in the compiled tiny model on data 2 x fsdp 2 x tensor 2 against AdamW's step: +35 all-gathers, +68
all-reduces, +105 collective-permutes for 7 weights x 5 steps) one all-gather of an operand along one of its
split dimensions (the operand stays split along the other), about two all-reduces of partial products
(contractions over a split dimension) and three collective-permutes that re-lay the products out between
``X X^T`` and ``(.) X``; the Frobenius norm is an all-reduce of one scalar per matrix. No rank holds a whole
matrix, the momentum and the update stay in the parameter's sharding, but these collectives are per step and
latency-bound at small shapes (gathering each matrix to one rank per layer, as torchtitan's DistMuon and
Megatron's layer-wise Muon do, is the alternative this does not build). The numbers do not depend on the
layout: tests/test_muon.py checks equality with one device.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxtron.config import OptimConfig

HIDDEN_AXES = ("heads", "kv_heads", "head_dim", "mlp")
Dims = optax.contrib.MuonDimensionNumbers


def dimension_numbers(names) -> Optional[Dims]:
    """How a weight with logical axis ``names`` is orthogonalised (its fan_in and fan_out axes; the others are
    batch axes), or None when AdamW updates it."""
    names = tuple(names)
    hidden = tuple(i for i, n in enumerate(names) if n in HIDDEN_AXES)
    if "vocab" in names or "embed" not in names or not hidden:
        return None
    embed = (names.index("embed"),)
    return Dims(embed, hidden) if embed[0] < hidden[0] else Dims(hidden, embed)


def _is_names(x) -> bool:
    return isinstance(x, PartitionSpec)


def _is_dims(x) -> bool:
    return isinstance(x, Dims)


def labels(names: dict) -> dict:
    """``"muon"`` or ``"adam"`` for each leaf of the params' logical-names tree."""
    return jax.tree.map(lambda n: "muon" if dimension_numbers(n) else "adam", names, is_leaf=_is_names)


def _fans(shape, dims: Dims) -> tuple[int, int]:
    return (math.prod(shape[i] for i in dims.reduction_axis), math.prod(shape[i] for i in dims.output_axis))


def shape_scale(shape, dims: Dims, rms: float) -> float:
    """The factor an orthogonalised update of ``shape`` is multiplied by (see the module docstring)."""
    fan_in, fan_out = _fans(shape, dims)
    return rms * math.sqrt(max(fan_in, fan_out)) if rms > 0 else math.sqrt(max(1.0, fan_out / fan_in))


def scale_by_shape(dims: dict, rms: float) -> optax.GradientTransformation:
    def update(updates, state, params=None):
        del params
        scaled = jax.tree.map(lambda d, u: u * jnp.asarray(shape_scale(u.shape, d, rms), u.dtype),
                              dims, updates, is_leaf=_is_dims)
        return scaled, state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def muon(o: OptimConfig, schedule: optax.Schedule, names: dict,
         adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """Muon on the hidden matrices of a params tree whose logical axis names (PartitionSpecs of names, the
    layout of the params' pure dict) are ``names``; ``adam`` on the other leaves."""
    dims = jax.tree.map(lambda n: dimension_numbers(n) or optax.MaskedNode(), names, is_leaf=_is_names)
    orthogonalised = optax.chain(
        optax.contrib.scale_by_muon(ns_steps=o.muon_ns_steps, beta=o.muon_beta, nesterov=o.muon_nesterov,
                                    weight_dimension_numbers=dims),
        scale_by_shape(dims, o.muon_rms),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": orthogonalised, "adam": adam}, labels(names))
