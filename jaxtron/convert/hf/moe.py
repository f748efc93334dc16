"""The Mixture-of-Experts side of the Hugging Face mapping: ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``DeepseekV3ForCausalLM`` config keys <-> :class:`~jaxtron.config.schema.MoEConfig`, the checks for MoE configs a
HF class cannot hold, and which HF decoder layer each jaxtron layer stack holds (for the weights,
:mod:`jaxtron.convert.hf.weights`).

Layer kinds. Qwen3-MoE layer ``i`` is MoE when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step
== 0``; jaxtron's layer ``i >= first_dense_layers`` is MoE when ``(i - first_dense_layers + 1) % layer_freq ==
0`` (and the layers before are dense). Import accepts any HF pattern that some (first_dense_layers,
layer_freq) reproduces exactly (decoder_sparse_step -> layer_freq; mlp_only_layers = [0..N-1] ->
first_dense_layers = N; layer_freq = decoder_sparse_step where it can be, then the fewest first dense layers) and
refuses the rest. Export writes decoder_sparse_step = layer_freq (1 when first_dense_layers is not a multiple of
it) and as mlp_only_layers the layers that step would make MoE but jaxtron keeps dense; a round trip gives the
same config whenever first_dense_layers is 0 or layer_freq is 1.

DeepSeek-V3 layer ``i`` is MoE when ``i >= first_k_dense_replace`` (= first_dense_layers, layer_freq 1). Its
router is jaxtron's DeepSeek routing (sigmoid scores, group-limited top-k, renormalized top-k weights times
routed_scaling_factor) and always carries the aux-free bias ``e_score_correction_bias``, so import sets
aux_free_bias and export writes a zero bias for a model without one. Its shared experts are one SwiGLU of
width ``moe_intermediate_size * n_shared_experts`` (jaxtron's ``mlp.shared``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxtron.config.model_schema import MoEConfig

MIXTRAL, QWEN3_MOE, DEEPSEEK_V3 = "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)


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


def _check_deepseek_v3_hf(hf: Mapping, source: str) -> None:
    """Raise (one line) for DeepSeek-V3 checkpoint options jaxtron's model does not implement (some are keys of
    DeepSeek's own config.json that transformers ignores, so a checkpoint could say one thing and run another)."""
    if hf.get("quantization_config"):
        method = dict(hf["quantization_config"]).get("quant_method")
        raise ValueError(f"{source}: quantization_config (quant_method={method!r}) is not supported; convert the "
                         f"checkpoint to bf16/fp32 weights first (DeepSeek's fp8_cast_bf16.py)")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key) is not None and hf[key] != want:
            raise ValueError(f"{source}: {key}={hf[key]!r} is not supported (DeepseekV3ForCausalLM runs {want!r})")
    if not int(hf.get("n_shared_experts") or 0):
        raise ValueError(f"{source}: n_shared_experts=0 is not supported (DeepseekV3ForCausalLM always builds the "
                         f"shared expert MLP)")


def check_moe_hf(hf: Mapping, arch: str, source: str) -> None:
    """Raise (one line) for Qwen3-MoE and DeepSeek-V3 options jaxtron's model does not implement."""
    if arch == DEEPSEEK_V3:
        _check_deepseek_v3_hf(hf, source)
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
    if arch == DEEPSEEK_V3:
        return _deepseek_v3_moe(hf, num_layers, source), int(_req(hf, "intermediate_size", source))
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


def _deepseek_v3_moe(hf: Mapping, num_layers: int, source: str) -> MoEConfig:
    """DeepSeek-V3's MoE: layers from first_k_dense_replace on, sigmoid scores, grouped top-k, the aux-free
    bias (the checkpoint always holds one; training moves it at jaxtron's default rate)."""
    first = int(hf.get("first_k_dense_replace") or 0)
    if first >= num_layers:
        raise ValueError(f"{source}: first_k_dense_replace={first} leaves no MoE layer of {num_layers}; jaxtron "
                         f"imports DeepseekV3ForCausalLM with MoE layers only")
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{source}: required key 'n_routed_experts' is missing")
    return MoEConfig(num_experts=int(experts), num_experts_per_token=int(_req(hf, "num_experts_per_tok", source)),
                     expert_intermediate_size=int(_req(hf, "moe_intermediate_size", source)),
                     num_shared_experts=int(_req(hf, "n_shared_experts", source)), first_dense_layers=first,
                     score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                     n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                     aux_free_bias=True)


def _check_deepseek_v3_export(cfg) -> None:
    e = cfg.moe
    needs = {"score_func": "sigmoid", "layer_freq": 1, "shared_expert_gate": False}
    for name, want in needs.items():
        if getattr(e, name) != want:
            raise ValueError(f"model.moe.{name}: {getattr(e, name)!r} has no {DEEPSEEK_V3} equivalent (needs "
                             f"{want!r})")
    if e.num_shared_experts < 1:
        raise ValueError(f"model.moe.num_shared_experts: {DEEPSEEK_V3} always has shared experts (needs >= 1)")
    if e.shared_expert_intermediate_size not in (None, e.expert_intermediate_size):
        raise ValueError(f"model.moe.shared_expert_intermediate_size: {e.shared_expert_intermediate_size} has no "
                         f"{DEEPSEEK_V3} equivalent (its shared experts are model.moe.expert_intermediate_size="
                         f"{e.expert_intermediate_size} wide)")
    if cfg.qkv_bias or cfg.qk_norm:
        raise ValueError(f"model.{'qkv_bias' if cfg.qkv_bias else 'qk_norm'}: {DEEPSEEK_V3} has no "
                         f"{'Q/K/V bias' if cfg.qkv_bias else 'Q/K norms'}")


def check_moe_export(cfg, arch: str) -> None:
    """The MoE configs ``arch`` can hold: softmax top-k (Mixtral: renormalized, every layer routed), no shared
    experts, grouping, scaling or biases (they have no spelling in either class); Q/K norms exactly for
    Qwen3-MoE. DeepSeek-V3: sigmoid scores, every layer after the first dense ones MoE, shared experts of the
    routed experts' width, no Q/K norms or biases."""
    if arch == DEEPSEEK_V3:
        _check_deepseek_v3_export(cfg)
        return
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
    if arch == DEEPSEEK_V3:
        return dict(n_routed_experts=e.num_experts, num_experts_per_tok=e.num_experts_per_token,
                    moe_intermediate_size=e.expert_intermediate_size, n_shared_experts=e.num_shared_experts,
                    first_k_dense_replace=e.first_dense_layers, norm_topk_prob=e.norm_topk_prob,
                    routed_scaling_factor=float(e.routed_scaling_factor), n_group=e.n_group,
                    topk_group=e.topk_group, output_router_logits=False)
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
    the jaxtron key under ``mlp`` (and whether it is an output projection). DeepSeek-V3 (MLA models) and
    Qwen3-MoE share the names; DeepSeek-V3's extra router bias and shared experts are
    :func:`deepseek_v3_extra_names`'s."""
    # Qwen3-MoE and DeepSeek-V3 (transformers 5 fuses gate/up in memory but writes and reads these names)
    if cfg.qk_norm or cfg.mla.kv_lora_rank:
        return ("mlp.gate.weight", "router"), [("mlp.experts.{j}.gate_proj.weight", "w_gate", False),
                                               ("mlp.experts.{j}.up_proj.weight", "w_up", False),
                                               ("mlp.experts.{j}.down_proj.weight", "w_down", True)]
    return ("block_sparse_moe.gate.weight", "router"), [("block_sparse_moe.experts.{j}.w1.weight", "w_gate", False),
                                                        ("block_sparse_moe.experts.{j}.w2.weight", "w_down", True),
                                                        ("block_sparse_moe.experts.{j}.w3.weight", "w_up", False)]


def deepseek_v3_extra_names() -> tuple[tuple[str, str], list[tuple[str, tuple[str, str], bool]]]:
    """DeepSeek-V3's MoE names beyond :func:`moe_weight_names` (after ``model.layers.{i}.``): the router's
    aux-free bias [E] with its jaxtron key under ``mlp``, and the shared experts' gate/up/down weights with their
    jaxtron path under ``mlp`` (and whether each is an output projection)."""
    return ("mlp.gate.e_score_correction_bias", "expert_bias"), [
        ("mlp.shared_experts.gate_proj.weight", ("shared", "w_gate"), False),
        ("mlp.shared_experts.up_proj.weight", ("shared", "w_up"), False),
        ("mlp.shared_experts.down_proj.weight", ("shared", "w_down"), True)]
