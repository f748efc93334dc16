"""The Mixture-of-Experts side of the Hugging Face mapping: ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``
config keys <-> :class:`~jaxtron.config.schema.MoEConfig`, the checks for MoE configs a HF class cannot hold,
and which HF decoder layer each jaxtron layer stack holds (for the weights, :mod:`jaxtron.convert.hf.weights`).

Layer kinds. Qwen3-MoE layer ``i`` is MoE when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step
== 0``; jaxtron's layer ``i >= first_dense_layers`` is MoE when ``(i - first_dense_layers + 1) % layer_freq ==
0`` (and the layers before are dense). Import accepts any HF pattern that some (first_dense_layers,
layer_freq) reproduces exactly (decoder_sparse_step -> layer_freq; mlp_only_layers = [0..N-1] ->
first_dense_layers = N; layer_freq = decoder_sparse_step where it can be, then the fewest first dense layers) and
refuses the rest. Export writes decoder_sparse_step = layer_freq (1 when first_dense_layers is not a multiple of
it) and as mlp_only_layers the layers that step would make MoE but jaxtron keeps dense; a round trip gives the
same config whenever first_dense_layers is 0 or layer_freq is 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxtron.config.schema import MoEConfig

MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN3_MOE)


def _req(hf: Mapping, key: str, source: str) -> Any:
    if hf.get(key) is None:
        raise ValueError(f"{source}: required key {key!r} is missing")
    return hf[key]


def moe_layers(num_layers: int, first_dense: int, freq: int) -> list[int]:
    """jaxtron's MoE layer indices for (first_dense_layers, layer_freq)."""
    return [i for i in range(first_dense, num_layers) if (i - first_dense + 1) % freq == 0]


def _qwen3_moe_layers(hf: Mapping, num_layers: int, source: str) -> tuple[int, int]:
    """(first_dense_layers, layer_freq) reproducing the config's decoder_sparse_step and mlp_only_layers."""
    step = int(hf.get("decoder_sparse_step") or 1)
    mlp_only = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
    want = [i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0]
    if not want:
        raise ValueError(f"{source}: decoder_sparse_step={step} and mlp_only_layers={mlp_only} leave no MoE "
                         f"layer; load it as a dense model")
    for freq in [step] + list(range(1, num_layers + 1)):  # decoder_sparse_step if it can be, then the fewest
        for first in range(num_layers):                    # first dense layers
            if (num_layers - first) % freq == 0 and moe_layers(num_layers, first, freq) == want:
                return first, freq
    raise ValueError(f"{source}: decoder_sparse_step={step} with mlp_only_layers={mlp_only} (MoE layers {want} "
                     f"of {num_layers}) is not supported; jaxtron's MoE layers are every model.moe.layer_freq-th "
                     f"after model.moe.first_dense_layers, the count after them a multiple of it")


def check_moe_hf(hf: Mapping, arch: str, source: str) -> None:
    """Raise (one line) for Qwen3-MoE options jaxtron's model does not implement."""
    if arch != QWEN3_MOE:
        return
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for {QWEN3_MOE} (it adds Q/K/V and "
                         f"o_proj biases; jaxtron has no o_proj bias)")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (jaxtron attention is full causal)")


def moe_from_hf(hf: Mapping, arch: str, num_layers: int, source: str) -> tuple[MoEConfig, int]:
    """(model.moe, model.intermediate_size) of a MoE architecture's config."""
    aux = float(hf.get("router_aux_loss_coef", 0.0) or 0.0)
    if arch == MIXTRAL:  # every layer: softmax over the router logits, top-k renormalized
        ffn = int(_req(hf, "intermediate_size", source))
        return MoEConfig(num_experts=int(_req(hf, "num_local_experts", source)),
                         num_experts_per_token=int(_req(hf, "num_experts_per_tok", source)),
                         expert_intermediate_size=ffn, score_func="softmax", norm_topk_prob=True,
                         aux_loss_coef=aux), ffn
    # Qwen3-MoE: softmax over all experts, top-k, renormalized when norm_topk_prob (transformers' default false)
    first, freq = _qwen3_moe_layers(hf, num_layers, source)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{source}: required key 'num_experts' is missing")
    return MoEConfig(num_experts=int(experts), num_experts_per_token=int(_req(hf, "num_experts_per_tok", source)),
                     expert_intermediate_size=int(_req(hf, "moe_intermediate_size", source)),
                     first_dense_layers=first, layer_freq=freq, score_func="softmax",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     aux_loss_coef=aux), int(_req(hf, "intermediate_size", source))


def check_moe_export(cfg, arch: str) -> None:
    """The MoE configs ``arch`` can hold: softmax top-k (Mixtral: renormalized, every layer routed), no shared
    experts, grouping, scaling or biases (they have no spelling in either class); Q/K norms exactly for
    Qwen3-MoE."""
    e, d = cfg.moe, dataclasses.asdict(MoEConfig())
    plain = {"num_shared_experts": 0, "score_func": "softmax", "routed_scaling_factor": 1.0, "n_group": 1,
             "aux_free_bias": False}
    if arch == MIXTRAL:
        plain.update(first_dense_layers=0, layer_freq=1, norm_topk_prob=True)
    for name, want in plain.items():
        if getattr(e, name) != want:
            raise ValueError(f"model.moe.{name}: {getattr(e, name)!r} has no {arch} equivalent (needs {want!r}; "
                             f"default {d[name]!r})")
    if cfg.qkv_bias:
        raise ValueError(f"model.qkv_bias: {arch} has no Q/K/V-only bias")
    if cfg.qk_norm != (arch == QWEN3_MOE):
        raise ValueError(f"model.qk_norm: {arch} {'needs' if arch == QWEN3_MOE else 'has no'} Q/K norms; "
                         f"save as {MIXTRAL if arch == QWEN3_MOE else QWEN3_MOE}")


def moe_to_hf(cfg, arch: str) -> dict:
    """The MoE keys of ``arch``'s config.json (after :func:`check_moe_export`)."""
    e = cfg.moe
    if arch == MIXTRAL:
        return dict(intermediate_size=e.expert_intermediate_size, num_local_experts=e.num_experts,
                    num_experts_per_tok=e.num_experts_per_token, router_aux_loss_coef=e.aux_loss_coef,
                    output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    n = cfg.num_layers
    ours = moe_layers(n, e.first_dense_layers, e.layer_freq)
    step = e.layer_freq if e.first_dense_layers % e.layer_freq == 0 else 1
    mlp_only = [i for i in range(n) if (i + 1) % step == 0 and i not in ours]
    return dict(num_experts=e.num_experts, num_experts_per_tok=e.num_experts_per_token,
                moe_intermediate_size=e.expert_intermediate_size, norm_topk_prob=e.norm_topk_prob,
                decoder_sparse_step=step, mlp_only_layers=mlp_only, router_aux_loss_coef=e.aux_loss_coef,
                output_router_logits=False, attention_bias=False, use_sliding_window=False, sliding_window=None)


def layer_blocks(cfg) -> list[tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """(jaxtron path of a stacked block, the HF layer index of each of its scanned units, is it MoE) for every
    kind of decoder block (see jaxtron.model.llama.layer_stacks)."""
    n, e = cfg.num_layers, cfg.moe
    if not e.num_experts:
        return [(("layers",), tuple(range(n)), False)]
    first, freq = e.first_dense_layers, e.layer_freq
    out = [(("dense_layers",), tuple(range(first)), False)] if first else []
    starts = range(first, n, freq)
    if freq == 1:
        return out + [(("layers",), tuple(starts), True)]
    out += [(("layers", f"dense_{s}"), tuple(i + s for i in starts), False) for s in range(freq - 1)]
    return out + [(("layers", "moe"), tuple(i + freq - 1 for i in starts), True)]


def moe_weight_names(cfg) -> tuple[tuple[str, str], list[tuple[str, str, bool]]]:
    """HF names (after ``model.layers.{i}.``) of the router and of expert ``{j}``'s gate/up/down weights, with
    the jaxtron key under ``mlp`` (and whether it is an output projection)."""
    if cfg.qk_norm:  # Qwen3-MoE (transformers 5 fuses gate/up in memory but writes and reads these names)
        return ("mlp.gate.weight", "router"), [("mlp.experts.{j}.gate_proj.weight", "w_gate", False),
                                               ("mlp.experts.{j}.up_proj.weight", "w_up", False),
                                               ("mlp.experts.{j}.down_proj.weight", "w_down", True)]
    return ("block_sparse_moe.gate.weight", "router"), [("block_sparse_moe.experts.{j}.w1.weight", "w_gate", False),
                                                        ("block_sparse_moe.experts.{j}.w2.weight", "w_down", True),
                                                        ("block_sparse_moe.experts.{j}.w3.weight", "w_up", False)]
