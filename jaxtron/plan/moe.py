"""Closed forms of Mixture-of-Experts layers for the planner: parameters (all experts), activations and the
routed experts' matmul FLOPs, both as jaxtron's train step compiles today and with a grouped-GEMM kernel.

What the compiled step does with the routed experts (read from XLA:GPU's optimized HLO, e.g. Mixtral-8x7B on
16 H100s; ``python -m jaxtron.plan`` counts the real figures from the HLO, these closed forms rank ``--search``
candidates before compiling):

* ``dropless`` argsorts the (token, expert) assignments of the whole micro batch. That dimension is split over
  the batch axes and GSPMD does not sort a split dimension in place, so every device gathers the assignments
  of all batch shards: its expert matmuls run on ``rows = micro batch x data x fsdp x seq x k`` rows (the
  global micro batch), their contraction (hidden) split over fsdp x context (the experts' ``embed`` axis) and
  their width over tensor. Over ``data`` the expert work is therefore repeated, not split.
* ``jax.lax.ragged_dot`` is lowered to a group-masked dense matmul: each row is multiplied by all E experts'
  weights (E times a grouped GEMM's FLOPs) and the input is expanded E times in memory.
* ``capacity`` runs dense einsums over ``E x C`` slots, ``C = ceil(capacity_factor x T x k / E)`` with T the
  tokens of the global micro batch (gathered the same way): ``capacity_factor`` times the active FLOPs.

A grouped-GEMM kernel over a dispatch that keeps each device's tokens local (neither is built) would execute
the active FLOPs, split like the rest of the model: Megatron's MoE count (:func:`jaxtron.train.flops.moe_ffn_flops`).
"""

from __future__ import annotations

import math
import re

from jaxtron.config import Config
from jaxtron.parallel.layout import Layout
from jaxtron.train.flops import moe_layer_count

GEMMS = ("as_compiled", "grouped")
# Name scopes of jaxtron/model/moe.py, found in the op_name metadata of the optimized HLO: the routed experts'
# matmuls are the dots under moe_experts; the collectives GSPMD inserts under either scope (gathering the
# assignments and tokens, reducing the experts' split contraction) carry activations the next op waits for.
EXPERT_MATMULS = r"moe_experts/"
DISPATCH_COLLECTIVES = re.compile(r"moe_router/|moe_experts/")


def shared_width(m) -> int:
    e = m.moe
    return e.num_shared_experts * (e.shared_expert_intermediate_size or e.expert_intermediate_size)


def ffn_params(m, active: bool = False) -> int:
    """Parameters of one MoE feed-forward block: the router, all E routed experts (only the top-k a token uses
    when ``active``), the shared experts and their gate, and the aux-free bias (state, but no FLOPs)."""
    e, d = m.moe, m.hidden_size
    routed = 3 * d * e.expert_intermediate_size * (e.num_experts_per_token if active else e.num_experts)
    gate = d if e.shared_expert_gate and e.num_shared_experts else 0
    bias = e.num_experts if e.aux_free_bias and not active else 0
    return d * e.num_experts + routed + 3 * d * shared_width(m) + gate + bias


def dispatch_rows(cfg: Config, layout: Layout) -> float:
    """Rows each device's routed-expert matmuls run on, per MoE layer and micro batch, as compiled (module
    doc): the assignments of the global micro batch, or the E x C capacity slots."""
    e = cfg.model.moe
    tokens = layout.micro_batch_size * layout.dp * cfg.data.seq_len
    if e.dispatch == "capacity":
        return e.num_experts * math.ceil(e.capacity_factor * tokens * e.num_experts_per_token / e.num_experts)
    return tokens * e.num_experts_per_token


def remat_factor(cfg: Config) -> float:
    return 4 / 3 if cfg.model.remat == "full" else 1.0


def expert_flops_per_device(cfg: Config, layout: Layout, gemm: str) -> float:
    """Training FLOPs per device per step of the routed experts' three matmuls (recomputation included)."""
    m, e = cfg.model, cfg.model.moe
    d, f = m.hidden_size, e.expert_intermediate_size
    layers = moe_layer_count(m) * 3 * remat_factor(cfg)  # forward + backward (2 x forward)
    if gemm == "grouped":
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        return layers * 2 * 3 * d * f * e.num_experts_per_token * tokens / layout.num_devices
    masked = e.num_experts if e.dispatch == "dropless" else 1
    per_micro = 2 * 3 * dispatch_rows(cfg, layout) * masked * d / layout.zero_shards * f / layout.tp
    return layers * per_micro * layout.accumulation_steps


def act_bytes_per_token(m, t: int, remat: str) -> float:
    """bf16 activations one MoE block keeps for the backward per local token, beside the attention's: the
    router's fp32 logits and probabilities, the routed rows (k gathered inputs, gate, up and outputs) and the
    shared experts'. ``remat=full`` keeps none of them (the layer input is counted with the attention)."""
    if remat == "full":
        return 0.0
    e = m.moe
    routed = e.num_experts_per_token * (2 * m.hidden_size + 3 * e.expert_intermediate_size / t)
    return 2 * 4 * e.num_experts + 2 * (routed + 3 * shared_width(m) / t)


def working_bytes(cfg: Config, layout: Layout) -> float:
    """The live set of one MoE layer's forward and backward on one device as compiled: the masked matmuls'
    inputs expanded E times (bf16) and their fp32 outputs on the dispatched rows, forward and backward."""
    m, e = cfg.model, cfg.model.moe
    rows = dispatch_rows(cfg, layout)
    d, f = m.hidden_size / layout.zero_shards, e.expert_intermediate_size / layout.tp
    expand = e.num_experts if e.dispatch == "dropless" else 1
    return 2 * (2 * rows * expand * (d + f) + 4 * rows * (2 * f + d))


def hbm_bytes(cfg: Config, layout: Layout, gemm: str) -> float:
    """HBM traffic per device per step of the routed experts beyond the dense closed form's: as compiled, the
    working set above written and read in the forward, the backward and the recomputation."""
    if gemm == "grouped":
        return 0.0
    write_and_read = 2 * remat_factor(cfg)
    return moe_layer_count(cfg.model) * write_and_read * working_bytes(cfg, layout) * layout.accumulation_steps


def dispatch_comm_bytes(cfg: Config, layout: Layout) -> float:
    """Wire bytes per device per step of the dispatch's collectives as compiled (ranking only): the fp32
    partial sums of the experts' split matmuls all-reduced, about twice their size on the wire, forward,
    backward and recomputation."""
    if layout.num_devices == 1:
        return 0.0
    m, e = cfg.model, cfg.model.moe
    width = 2 * e.expert_intermediate_size / layout.tp + m.hidden_size
    passes = 3 * remat_factor(cfg)
    return moe_layer_count(m) * passes * 2 * 4 * dispatch_rows(cfg, layout) * width * layout.accumulation_steps
