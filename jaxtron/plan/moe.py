"""Closed forms of Mixture-of-Experts layers for the planner: parameters (all experts), activations and the
routed experts' matmul FLOPs, both as jaxtron's train step compiles today and with a grouped-GEMM kernel.

What the compiled step does with the routed experts (read from XLA:GPU's optimized HLO, e.g. Mixtral-8x7B on
16 H100s; ``python -m jaxtron.plan`` counts the real figures from the HLO, these closed forms rank ``--search``
candidates before compiling):

* ``dropless`` runs each device's own tokens through the experts inside a ``shard_map`` over the batch (and
  context) axes (:func:`jaxtron.parallel.expert.dispatch`): ``rows = t x k`` with ``t = micro batch x seq /
  context`` per device, the experts' hidden dim gathered at the shard_map boundary (like FSDP's other
  gathers) and their width split over tensor; no dispatch collective. (Left to GSPMD, the sort over the
  batch-split assignments gathered the global micro batch onto every device and repeated the expert work
  over ``data``.) On a single device, the whole micro batch.
* ``jax.lax.ragged_dot`` is lowered to a group-masked dense matmul: each row is multiplied by all E experts'
  weights (E times a grouped GEMM's FLOPs) and the input is expanded E times in memory.
* ``capacity`` runs dense einsums over ``E x C`` slots, ``C = ceil(capacity_factor x T x k / E)`` with T the
  tokens of the global micro batch (GSPMD gathers them for the slot assignment): ``capacity_factor`` times
  the active FLOPs, repeated over ``data``.

With expert parallelism (``parallel.expert`` > 1, dropless) the dispatch is jaxtron's own
(:mod:`jaxtron.parallel.expert`): each device keeps its tokens (``t = micro batch x seq / context``) and
exchanges buffers of ``EP x C`` rows, ``C = min(ceil(ep_capacity_factor x t x k / EP), t x min(k, E/EP))`` per
peer (the second term, the worst case, when the factor is null), over the
``expert`` axis with all-to-all, forward and backward; the received rows run through the local experts'
grouped matmuls (masked over the E/EP local experts as compiled), their hidden dim gathered (the experts enter
the dispatch's shard_map split over ``expert`` only) and their width split over tensor. ``ragged_all_to_all``
receives into one buffer of the same EP x C rows but moves only the rows sent (t x k per device when the load
is balanced).

A grouped-GEMM kernel (``model.moe.gmm_impl=pallas``) runs only the rows of real groups: the active FLOPs,
split like the rest of the model: Megatron's MoE count (:func:`jaxtron.train.flops.moe_ffn_flops`).
"""

from __future__ import annotations

import math
import re

from jaxtron.config import Config, gmm_impl
from jaxtron.plan import hlo
from jaxtron.parallel.expert import capacity, dispatch_tokens, exchange_chunks
from jaxtron.parallel.layout import Layout
from jaxtron.train.flops import moe_layer_count

GEMMS = ("as_compiled", "grouped")
# Name scopes of jaxtron/model/moe.py, found in the op_name metadata of the optimized HLO: the routed experts'
# matmuls are the dots under moe_experts; the collectives GSPMD inserts under either scope (gathering the
# assignments and tokens, reducing the experts' split contraction) carry activations the next op waits for.
# With expert parallelism only the exchanges are such: the expert weights' FSDP gathers at the dispatch's
# shard_map boundary carry the same scope but overlap like every other weight gather.
EXPERT_MATMULS = r"moe_experts/"
DISPATCH_COLLECTIVES = re.compile(r"moe_router/|moe_experts/")
EXCHANGES = ("all-to-all", "ragged-all-to-all")
# the routed experts' matmuls in the optimized HLO's op_name metadata (ragged_dot's fallback or the Pallas kernel)
EXPERT_MATMUL_OPS = r"moe_experts/[^\"]*(ragged_dot|pallas_call)"


def expert_parallel(cfg: Config, layout: Layout) -> bool:
    """Whether the dropless dispatch runs over the ``expert`` axis (jaxtron.parallel.expert)."""
    return layout.expert > 1 and cfg.model.moe.dispatch == "dropless"


def keeps_tokens(cfg: Config, layout: Layout) -> bool:
    """Whether each device dispatches only its own tokens (dropless, with the batch or sequence split: the
    dispatch's shard_map, with or without an expert axis)."""
    return cfg.model.moe.dispatch == "dropless" and layout.dp * layout.context > 1


def ep_rows(cfg: Config, layout: Layout) -> int:
    """EP x C rows each device receives per MoE layer and micro batch (module doc); with ``ep_overlap``, the
    sum over its chunks."""
    e = cfg.model.moe
    t = _own_tokens(cfg, layout)
    parts = exchange_chunks(e, t)
    return parts * layout.expert * capacity(t // parts, e.num_experts_per_token, layout.expert,
                                            e.num_experts // layout.expert, e.ep_capacity_factor)


def _splits_sequence_over_tensor(cfg: Config, layout: Layout) -> bool:
    return keeps_tokens(cfg, layout) and cfg.parallel.sequence_parallel and layout.tp > 1


def _own_tokens(cfg: Config, layout: Layout) -> int:
    """Tokens each device dispatches per micro batch (the dispatch's shard_map: its own sequences, split over
    context, and over tensor under sequence parallelism)."""
    return dispatch_tokens(cfg, layout.micro_batch_size, layout.context, layout.tp)


def _width(cfg: Config, layout: Layout) -> float:
    """The routed experts' width as each device multiplies it: whole where each tensor rank dispatches its own
    part of the sequence (sequence parallelism), else split over tensor."""
    f = cfg.model.moe.expert_intermediate_size
    return f if _splits_sequence_over_tensor(cfg, layout) else f / layout.tp


def ragged_sent_fraction(cfg: Config, layout: Layout) -> float:
    """``ragged_all_to_all``: the rows sent over the buffer's rows, for a balanced load (t x k of EP x C)."""
    return min(1.0, _own_tokens(cfg, layout) * cfg.model.moe.num_experts_per_token / ep_rows(cfg, layout))


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
    doc): with expert parallelism the EP x C received rows, else the device's own assignments (dropless) or the
    E x C capacity slots of the global micro batch."""
    e = cfg.model.moe
    if expert_parallel(cfg, layout):
        return ep_rows(cfg, layout)
    if keeps_tokens(cfg, layout):
        return _own_tokens(cfg, layout) * e.num_experts_per_token
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
    if gemm == "grouped" or runs_grouped_kernel(cfg):
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        return layers * 2 * 3 * d * f * e.num_experts_per_token * tokens / layout.num_devices
    masked = _masked_groups(cfg, layout)
    per_micro = 2 * 3 * dispatch_rows(cfg, layout) * masked * _contraction(cfg, layout) * _width(cfg, layout)
    return layers * per_micro * layout.accumulation_steps


def runs_grouped_kernel(cfg: Config) -> bool:
    """Whether a GPU program of ``cfg`` runs its routed experts through the Pallas grouped GEMM (whose calls
    the HLO does not count as dots: it executes the active rows' FLOPs)."""
    return cfg.model.moe.dispatch == "dropless" and gmm_impl(cfg.model, gpu=True) == "pallas"


def _masked_groups(cfg: Config, layout: Layout) -> int:
    """Experts each dispatched row is multiplied by as compiled (ragged_dot's masked dense fallback)."""
    e = cfg.model.moe
    if e.dispatch != "dropless":
        return 1
    return e.num_experts // layout.expert if expert_parallel(cfg, layout) else e.num_experts


def _contraction(cfg: Config, layout: Layout) -> float:
    """The experts' hidden dim as each device multiplies it: gathered inside the dispatch's shard_map, split
    over fsdp x context by GSPMD otherwise (capacity dispatch)."""
    d = cfg.model.hidden_size
    return d if keeps_tokens(cfg, layout) else d / layout.zero_shards


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
    e = cfg.model.moe
    rows = dispatch_rows(cfg, layout)
    d, f = _contraction(cfg, layout), _width(cfg, layout)
    expand = _masked_groups(cfg, layout)
    return 2 * (2 * rows * expand * (d + f) + 4 * rows * (2 * f + d))


def hbm_bytes(cfg: Config, layout: Layout, gemm: str) -> float:
    """HBM traffic per device per step of the routed experts beyond the dense closed form's: as compiled, the
    working set above written and read in the forward, the backward and the recomputation."""
    if gemm == "grouped":
        return 0.0
    write_and_read = 2 * remat_factor(cfg)
    return moe_layer_count(cfg.model) * write_and_read * working_bytes(cfg, layout) * layout.accumulation_steps


def dispatch_comm_bytes(cfg: Config, layout: Layout) -> float:
    """Wire bytes per device per step of the dispatch's collectives (ranking only). Expert parallelism: the
    bf16 rows exchanged there and back, forward, backward and recomputation (:func:`exchange_bytes`). As
    compiled without it: the fp32 partial sums of the experts' split matmuls all-reduced, about twice their
    size on the wire, forward, backward and recomputation (capacity dispatch; dropless keeps its tokens)."""
    if layout.num_devices == 1:
        return 0.0
    if expert_parallel(cfg, layout):
        return exchange_bytes(cfg, layout)
    if keeps_tokens(cfg, layout):
        return 0.0
    m, e = cfg.model, cfg.model.moe
    width = 2 * e.expert_intermediate_size / layout.tp + m.hidden_size
    passes = 3 * remat_factor(cfg)
    return moe_layer_count(m) * passes * 2 * 4 * dispatch_rows(cfg, layout) * width * layout.accumulation_steps


def exchange_bytes(cfg: Config, layout: Layout) -> float:
    """All-to-all wire bytes per device per step of the expert-parallel dispatch: per MoE layer and micro
    batch, two exchanges of EP x C bf16 rows of the hidden size forward and two backward (two more under
    remat=full: the recomputation re-sends), (EP-1)/EP of each leaving the device; ragged_all_to_all
    sends only the rows routed there (:func:`ragged_sent_fraction`)."""
    e, ep = cfg.model.moe, layout.expert
    exchanges = 4 + (2 if cfg.model.remat == "full" else 0)
    rows = dispatch_rows(cfg, layout)
    if e.ep_dispatch == "ragged_all_to_all":
        rows *= ragged_sent_fraction(cfg, layout)
    per_exchange = rows * cfg.model.hidden_size * 2 * (ep - 1) / ep
    return moe_layer_count(cfg.model) * exchanges * per_exchange * layout.accumulation_steps


# What XLA:GPU runs as GEMMs or as no kernel at all; everything else under the dispatch's scope moves memory.
_NOT_MEMORY_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                   "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "dot",
                   "fusion-done", "async-done", "copy-done"}
_SLICE_OPS = ("dynamic-slice", "slice", "gather")


def dispatch_memory(text: str, hbm_bytes_per_s: float) -> dict:
    """The MoE dispatch's memory-bound work in an optimized module: every executed instruction whose op_name is
    under the ``moe_experts`` scope that is no GEMM (dot fusions, cuBLAS calls, the Pallas grouped matmuls),
    no collective and no control flow, times how often its computation runs per step (loop trip counts).
    Bytes: its operands' and result's (a gather or slice: twice its result), a simpler count than the step
    model's (which reads only the slices a fusion takes of a stacked operand), so the two are close but not
    equal; ``seconds`` at ``hbm_bytes_per_s``. ``top``: the five costliest instructions."""
    mod = hlo.parse_module(text)
    mult = mod.multipliers()
    inner = set()  # fusion bodies and reducers: their instructions are not kernels of their own
    for instrs in mod.computations.values():
        for _n, _s, opcode, rest in instrs:
            callees = dict(hlo.CALLEE_RE.findall(rest))
            if opcode in ("fusion", "fusion-start") and "calls" in callees:
                inner.add(callees["calls"])
            if "to_apply" in callees:
                inner.add(callees["to_apply"])
    total, ops, per = 0.0, 0.0, {}
    for comp, instrs in mod.computations.items():
        runs = mult.get(comp, 0.0)
        if comp in inner or not runs:
            continue
        shapes = {n: sh for n, sh, _op, _r in instrs}
        for name, shape, opcode, rest in instrs:
            op_name = hlo.OP_NAME_RE.search(rest)
            if (not op_name or not re.search(EXPERT_MATMULS, op_name.group(1)) or opcode in _NOT_MEMORY_OPS
                    or any(k in opcode for k in EXCHANGES + ("all-gather", "all-reduce", "reduce-scatter",
                                                            "collective-permute", "async-start"))
                    or hlo.is_gemm_call(opcode, rest) or "pallas_call" in op_name.group(1)):
                continue
            if opcode == "fusion" and _is_gemm_fusion(mod, rest):
                continue
            out = hlo.shape_bytes(shape)
            moved = 2.0 * out if opcode in _SLICE_OPS else out + sum(
                hlo.shape_bytes(hlo.operand_shape(shapes, o)) for o in hlo.operand_names(rest))
            total += runs * moved
            ops += runs
            per[name] = (runs * moved, op_name.group(1)[-90:], shape[:60])
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:5]
    return {"bytes": total, "seconds": total / hbm_bytes_per_s, "ops": ops,
            "top": [{"instruction": n, "bytes": b, "op": o, "shape": s} for n, (b, o, s) in top]}


def _is_gemm_fusion(mod, rest: str) -> bool:
    body = mod.computations.get(dict(hlo.CALLEE_RE.findall(rest)).get("calls", ""), [])
    return any(op == "dot" or hlo.is_gemm_call(op, r) for _n, _s, op, r in body)
