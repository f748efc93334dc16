"""Closed-form counts and the roofline model behind ``python -m jaxtron.plan``.

Roofline, per device and per optimizer step:

* compute: hardware FLOPs / (bf16 peak x ``compute_efficiency``); with ``model.fp8`` the FP8 GEMMs' share
  (:func:`fp8_flops_per_device`) at the FP8 peak instead (a prediction: no FP8 step has been timed). Hardware
  FLOPs are the Megatron model FLOPs (:func:`jaxtron.train.flops.flops_per_token`, causal attention counted
  under the ``causal`` convention, i.e. the s^2 term halved, which is what a causal flash kernel executes)
  times the recomputation factor: 4/3 under ``remat=full`` (the forward runs twice), 1 otherwise
  (``save_dots`` recomputes only elementwise work).
* memory: HBM bytes / HBM bandwidth, from a closed-form traffic estimate (weights read three times per micro
  batch, activations written and read, the AdamW update reading and writing params, moments and gradients).
  Matmuls and the memory-bound kernels (norms, activations, softmax statistics, the optimizer) run one after
  the other, so the kernel time is their sum.
* communication: every collective of the compiled step (:mod:`jaxtron.plan.hlo`), wire bytes / (link bandwidth
  x ``comm_efficiency``) and latency as NCCL's tuning model times them (:mod:`jaxtron.plan.nccl`); the link is
  NVLink when the replica group stays inside a node and the network when it spans nodes. Collectives over the ``tensor`` axis alone (Megatron TP/SP
  activations) sit on the critical path and are added; the others (FSDP weight gathers, gradient
  reduce-scatters and data-parallel all-reduces) are scheduled asynchronously by XLA and only the part longer
  than the compute is added.

step time = compute + memory + exposed comm + max(0, overlappable comm - (compute + memory)).
MFU = Megatron model FLOPs (``full`` convention, as Megatron's published tables) / (GPUs x bf16 peak x step
time), also with FP8 (as Megatron and NeMo publish FP8 runs);
the ``causal`` convention is reported next to it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxtron.config import Config, gmm_impl, head_dim
from jaxtron.parallel.layout import Layout
from jaxtron.parallel.pipeline import CAST_BEFORE_LOOP
from jaxtron.parallel.zero_bubble_v_table import zbv_arrays, zbv_table
from jaxtron.plan import moe as pmoe
from jaxtron.plan import nccl
from jaxtron.plan.gpus import GpuSpec
from jaxtron.train.flops import flops_per_token, moe_layer_count

def attention_params(m) -> int:
    d, h, kv, hd = m.hidden_size, m.num_heads, m.num_kv_heads, head_dim(m)
    if m.mla.kv_lora_rank:  # jaxtron/model/mla.py's weights and norms
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        query = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * qk if a.q_lora_rank else d * h * qk
        return (query + d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
                + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim) + h * a.v_head_dim * d)
    bias = (h + 2 * kv) * hd if m.qkv_bias else 0
    qk_norm = 2 * hd if m.qk_norm else 0
    return d * (h + 2 * kv) * hd + h * hd * d + bias + qk_norm


def layer_params(m, moe: bool = False, active: bool = False) -> int:
    """One decoder layer: attention, the feed-forward block (dense SwiGLU, or MoE with all experts, or only
    the experts a token uses when ``active``) and the two norms."""
    ffn = pmoe.ffn_params(m, active) if moe else 3 * m.hidden_size * m.intermediate_size
    return attention_params(m) + ffn + 2 * m.hidden_size


def param_count(m, active: bool = False) -> int:
    """All parameters (every expert), or the ones a token is multiplied by when ``active``."""
    emb = m.vocab_size * m.hidden_size
    n_moe = moe_layer_count(m)
    layers = (m.num_layers - n_moe) * layer_params(m) + n_moe * layer_params(m, True, active)
    return emb * (1 if m.tie_embeddings else 2) + layers + m.hidden_size


def routed_expert_params(m) -> int:
    """The routed experts' weights of all MoE layers: what ``parallel.expert`` splits."""
    return moe_layer_count(m) * 3 * m.hidden_size * m.moe.expert_intermediate_size * m.moe.num_experts


def largest_layer_params(m, expert: int = 1) -> int:
    """The largest layer's parameters on an expert rank (the routed experts split ``expert`` ways)."""
    if not moe_layer_count(m):
        return layer_params(m)
    return max(layer_params(m), layer_params(m, True) - routed_expert_params(m) // moe_layer_count(m)
               * (expert - 1) // expert)


def param_bytes(m) -> int:
    """Bytes of one stored weight (``model.param_dtype``)."""
    return 2 if m.param_dtype in ("bfloat16", "float16") else (8 if m.param_dtype == "float64" else 4)


def closed_form_state_bytes(cfg: Config, layout: Layout) -> dict:
    """Per-device bytes of params, AdamW state and gradients: every matrix is split over fsdp x context (its
    hidden dim) and tensor (heads / mlp / vocab), the routed experts also over expert; norms and biases are
    small and counted as split the same way."""
    m = cfg.model
    pbytes = param_bytes(m)
    n = param_count(m)
    local = n - routed_expert_params(m) * (layout.expert - 1) / layout.expert
    shard = layout.zero_shards * layout.tp * layout.stages  # pipeline stages hold 1/S of the layers each
    return {"params": local * pbytes / shard, "optimizer": 2 * local * pbytes / shard,
            "grads": local * pbytes / shard, "param_count": n}


def _act_bytes_per_token_layer(m, t: int, sp: bool, remat: str, moe: bool = False, swiglu_kept: bool = True) -> float:
    """bf16 activations one layer keeps for the backward, per token (flash attention: no s^2 term); an MoE
    layer's feed-forward part is :func:`jaxtron.plan.moe.act_bytes_per_token`. ``swiglu_kept``: count what
    XLA:GPU's buffers hold of the SwiGLU under ``none`` (memory); the roofline's HBM traffic leaves it out."""
    d, h, kv, hd, f = m.hidden_size, m.num_heads, m.num_kv_heads, head_dim(m), m.intermediate_size
    dt = t if sp else 1
    tensor_part = ((h + 2 * kv) * hd + h * hd + (0 if moe else 3 * f)) / t
    ffn = pmoe.act_bytes_per_token(m, t, remat) if moe else 0.0
    if remat == "none":
        # + fp32 norm inputs; + 5 more bf16 MLP-width tensors than the 3 above: what XLA:GPU keeps of the SwiGLU
        # (Llama-3-70B on 64 H100, micro batch 1, tensor 4 x fsdp 16 and tensor 4 x stage 4 x fsdp 4 with 1f1b's 7
        # micro batches kept: the compiled peaks, 123.2 and 219.6 GiB, are 43.7 and 79.6 GiB above this count
        # without them; 5 f/t bf16 per token and layer are 43.8 and 76.6 GiB there)
        swiglu = 0 if moe or not swiglu_kept else 2 * 5 * f / t
        return 2 * (5 * d / dt + tensor_part) + 8 * d / dt + swiglu + ffn
    if remat == "save_dots":
        return 2 * (3 * d / dt + tensor_part) + ffn
    if remat == "save_dots_attention":
        # + what the flash kernel's backward reads (q, k, v, the output; the fp32 lse) and the context wo reads
        return 2 * (3 * d / dt + tensor_part) + ffn + (2 * ((h + 2 * kv) * hd + 2 * h * hd) + 4 * h) / t
    return 2 * d / dt  # full: the layer input only


def _act_bytes_per_token(m, t: int, sp: bool, remat: str, swiglu_kept: bool = True) -> float:
    """Summed over all layers, dense and MoE."""
    n_moe = moe_layer_count(m)
    return ((m.num_layers - n_moe) * _act_bytes_per_token_layer(m, t, sp, remat, swiglu_kept=swiglu_kept)
            + n_moe * _act_bytes_per_token_layer(m, t, sp, remat, moe=True))


def _w_stash_bytes_per_token(m, t: int) -> float:
    """What a split backward's W reads from its B, per token, over all layers: each weight dot's bf16 input
    activation and output cotangent (zbv's stash; jaxtron/parallel/zero_bubble_v.py), all counted split over
    ``tensor``. MoE layers count their routed experts' top-k width and the shared experts' as the SwiGLU's. On
    eight zbv layouts of Llama-3-70B (64 H100, save_dots, micro batch 1-2) this with the ring's slots came to
    0.82-1.0x XLA's compiled peak, where the residuals alone at the table's peak (no stash) came to 0.42-0.69x."""
    d, h, kv, hd = m.hidden_size, m.num_heads, m.num_kv_heads, head_dim(m)

    def layer(f):
        inputs = 2 * d + h * hd + f                  # Q/K/V's and gate/up's input, o's, down's
        cotangents = (h + 2 * kv) * hd + d + 2 * f + d  # Q/K/V's outputs, o's, gate's and up's, down's
        return 2 * (inputs + cotangents) / t

    n_moe = moe_layer_count(m)
    moe_f = m.moe.num_experts_per_token * m.moe.expert_intermediate_size + pmoe.shared_width(m) if n_moe else 0
    return (m.num_layers - n_moe) * layer(m.intermediate_size) + n_moe * layer(moe_f)


def _working_bytes(cfg: Config, layout: Layout, tokens: int, sp: bool) -> float:
    """One layer's forward + backward live set (the largest layer's)."""
    m, t = cfg.model, layout.tp
    dense = tokens * _act_bytes_per_token_layer(m, t, sp, "none") * 2
    if not moe_layer_count(m):
        return dense
    return max(dense, tokens * _act_bytes_per_token_layer(m, t, sp, "none", moe=True) * 2
               + pmoe.working_bytes(cfg, layout))


def closed_form_memory(cfg: Config, layout: Layout) -> dict:
    """A quick per-device memory estimate used to prune ``--search`` before compiling (not the reported
    number: the compiler's memory analysis is)."""
    m, s = cfg.model, cfg.data.seq_len
    t, b = layout.tp, layout.micro_batch_size
    sp = cfg.parallel.sequence_parallel and t > 1
    st = closed_form_state_bytes(cfg, layout)
    tokens = b * s // layout.context  # each context rank holds 1/context of the sequence
    # A stage's layers' saved activations per micro batch; under pipeline stages kept for every micro batch in
    # flight (1f1b: 2S - 1 on stage 0; gpipe and circular: all M), or with pipeline_recompute only the
    # micro batches' stage inputs (2S slots) and one micro batch's forward and backward at a time.
    saved = tokens * _act_bytes_per_token(m, t, sp, m.remat) / layout.stages
    if layout.stages > 1 and cfg.parallel.pipeline_recompute:
        saved += 2 * layout.stages * tokens * m.hidden_size * 2
    elif layout.stages > 1 and cfg.parallel.pipeline_schedule == "zbv":
        # its ring of (chunk, micro batch) slots as allocated (and the scratch slot), each holding a chunk's
        # residuals (half a stage's) and the stash its W reads from its B, and the buffer ring of
        # activation-sized inputs and output cotangents waiting for their F, B and W
        arrays = zbv_arrays(zbv_table(layout.stages, layout.accumulation_steps))
        stash = tokens * _w_stash_bytes_per_token(m, t) / (2 * layout.stages)
        saved = (arrays.res_slots + 1) * (saved / 2 + stash)
        saved += (arrays.buf_slots + 1) * tokens * m.hidden_size * 2 / (t if sp else 1)
    elif layout.stages > 1:
        in_flight = (2 * layout.stages - 1 if cfg.parallel.pipeline_schedule in ("1f1b", "zb_h1")
                     else layout.accumulation_steps)
        saved *= in_flight
    working = _working_bytes(cfg, layout, tokens, sp)
    logits = tokens * m.vocab_size / t * (2 + 4 + 4)
    gathered = 2 * 2 * largest_layer_params(m, layout.expert) / t if layout.zero_shards > 1 else 0
    acc = st["grads"] if layout.accumulation_steps > 1 else 0
    if gathers_stage_once(cfg, layout):  # the stage's weights (bf16 under 1f1b/zb_h1's cast once, else as
        #                                  stored) and its gradient accumulator unsharded over fsdp all step
        pbytes = param_bytes(m)
        stage_params = st["param_count"] / (t * layout.stages)
        wbytes = 2 if cfg.parallel.pipeline_schedule in CAST_BEFORE_LOOP and cfg.train.cast_params_once else pbytes
        gathered, acc = stage_params * wbytes, stage_params * pbytes
    temp = saved + working + logits + gathered + acc + st["grads"]
    total = st["params"] + st["optimizer"] + temp
    return {**st, "activations": saved + working + logits + gathered, "temp": temp, "total": total}


def hbm_bytes(cfg: Config, layout: Layout, moe_gemm: str = "as_compiled") -> float:
    """Closed-form HBM traffic per device per step (see module doc; MoE: :func:`jaxtron.plan.moe.hbm_bytes`)."""
    m, s = cfg.model, cfg.data.seq_len
    t, b, accum = layout.tp, layout.micro_batch_size, layout.accumulation_steps
    sp = cfg.parallel.sequence_parallel and t > 1
    n_local = param_count(m) / t
    weights = 3 * 2 * n_local * accum * (4 / 3 if m.remat == "full" else 1)
    act = 4 * b * s * _act_bytes_per_token(m, t, sp, "none", swiglu_kept=False) * accum
    logits = 3 * b * s * m.vocab_size / t * 4 * accum
    opt = 28 * param_count(m) / (layout.zero_shards * t)
    experts = pmoe.hbm_bytes(cfg, layout, moe_gemm) if moe_layer_count(m) else 0.0
    return weights + act + logits + opt + experts


def model_flops(cfg: Config, convention: str = "full") -> float:
    return flops_per_token(cfg.model, cfg.data.seq_len, convention) * cfg.train.global_batch_size * cfg.data.seq_len


def classify(op, layout: Layout, node_of: np.ndarray) -> tuple[tuple[str, ...], bool]:
    """(mesh axes the op's replica groups span, whether a group spans nodes)."""
    n = layout.num_devices
    if op.kind == "collective-permute":
        pairs = [(a, b) for a, b in (op.pairs or []) if a < n and b < n]
        return layout.axes_of_pairs(pairs), any(node_of[a] != node_of[b] for a, b in pairs)
    groups = op.groups if op.groups is not None else np.arange(n)[None]
    groups = groups[:, :][:, groups.min(0) >= 0] if groups.size else groups
    axes = layout.axes_of_group(list(groups[0])) if len(groups) else ()
    cross = bool(any(len(set(node_of[grp])) > 1 for grp in groups))
    return axes, cross


def hardware_flops_per_device(cfg: Config, layout: Layout, moe_gemm: str = "as_compiled",
                               expert_flops: Optional[float] = None) -> float:
    """FLOPs one device executes per step: the model FLOPs (causal convention) x recomputation, with the
    routed experts' share replaced by what runs: ``expert_flops`` (counted in the compiled HLO) or
    :func:`jaxtron.plan.moe.expert_flops_per_device` under ``moe_gemm``."""
    hw = model_flops(cfg, "causal") * pmoe.remat_factor(cfg) / layout.num_devices
    if not moe_layer_count(cfg.model):
        return hw
    if moe_gemm == "grouped" or expert_flops is None:
        expert_flops = pmoe.expert_flops_per_device(cfg, layout, moe_gemm)
    return hw - pmoe.expert_flops_per_device(cfg, layout, "grouped") + expert_flops


def fp8_flops_per_device(cfg: Config, layout: Layout, moe_gemm: str = "as_compiled",
                         expert_flops: Optional[float] = None) -> float:
    """Training FLOPs per device per step that ``model.fp8`` runs as FP8 GEMMs: the forward, dgrad and wgrad
    (and recomputation) of every attention projection, the dense layers' SwiGLU and the MoE layers' shared
    experts, and the routed experts where they run through ragged_dot (``as_compiled`` with
    ``gmm_impl=ragged_dot``: their executed FLOPs, ``expert_flops`` or the closed form); the grouped-GEMM
    kernel, the LM head and attention stay in bf16 (jaxtron/model/fp8.py)."""
    m = cfg.model
    if m.fp8 == "none":
        return 0.0
    routed = 0.0
    if moe_layer_count(m) and moe_gemm == "as_compiled" and gmm_impl(m, gpu=True) == "ragged_dot" \
            and m.moe.dispatch == "dropless":
        routed = expert_flops if expert_flops is not None else pmoe.expert_flops_per_device(cfg, layout, moe_gemm)
    d, h, kv, hd = m.hidden_size, m.num_heads, m.num_kv_heads, head_dim(m)
    n_moe = moe_layer_count(m)
    shared = pmoe.shared_width(m) if n_moe else 0
    params = m.num_layers * (2 * h + 2 * kv) * hd * d + 3 * d * ((m.num_layers - n_moe) * m.intermediate_size
                                                                 + n_moe * shared)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return 6.0 * tokens * params * pmoe.remat_factor(cfg) / layout.num_devices + routed


def compute_seconds(cfg: Config, layout: Layout, gpu: GpuSpec, hw_flops: float, moe_gemm: str = "as_compiled",
                    expert_flops: Optional[float] = None) -> float:
    """``hw_flops`` at ``compute_efficiency`` of the bf16 peak, the FP8 GEMMs' share at the FP8 peak."""
    fp8 = fp8_flops_per_device(cfg, layout, moe_gemm, expert_flops) if gpu.fp8_peak_tflops else 0.0
    eff = gpu.compute_efficiency * 1e12
    return (hw_flops - fp8) / (gpu.peak_tflops * eff) + (fp8 / (gpu.fp8_peak_tflops * eff) if fp8 else 0.0)


def collective_timing(cfg: Config, layout: Layout, gpu: GpuSpec, ops: list, node_of: np.ndarray,
                      moe_gemm: str) -> list:
    """Each collective's (op, seconds per execution, wire bytes per execution over the network and over NVLink,
    on the critical path by its axes), or seconds 0 for one left out: the link's bandwidth (NVLink inside a node,
    the network across) x ``comm_efficiency`` for its algorithm's wire bytes (a ring spanning nodes at the
    network's; an all-to-all's off-node share over the network beside its on-node share over NVLink), timed by
    NCCL's tuning model (:mod:`jaxtron.plan.nccl`: ring or tree, LL, LL128 or Simple, their latencies), plus
    ``collective_latency_us`` of launch overhead. The MoE dispatch's
    collectives carry activations (critical path); under ``grouped`` (a dispatch that keeps tokens on their
    device) those spanning the batch axes are left out."""
    moe = bool(moe_layer_count(cfg.model))
    ep = moe and pmoe.expert_parallel(cfg, layout)
    own = moe and pmoe.keeps_tokens(cfg, layout)  # the dispatch's collectives are its exchanges only
    out = []
    for op in ops:
        axes, cross = classify(op, layout, node_of)
        dispatch = moe and bool(pmoe.DISPATCH_COLLECTIVES.search(op.op_name)) and (
            not own or op.kind in pmoe.EXCHANGES)
        if op.wire_bytes == 0 or (dispatch and moe_gemm == "grouped" and not layout.on_critical_path(axes)):
            out.append((op, 0.0, 0.0, 0.0, False))
            continue
        wire = op.wire_bytes
        if op.kind == "ragged-all-to-all" and ep:  # its buffers are the worst case; it sends the routed rows
            wire *= pmoe.ragged_sent_fraction(cfg, layout)
        # a ring crosses the network at every step when it spans nodes; an exchange sends each peer its share,
        # the other nodes' over the network while the node's own go over NVLink at the same time
        nodes, share = _node_spread(op, node_of) if cross else (1, 0.0)
        remote = (share if op.kind in pmoe.EXCHANGES else 1.0) if cross else 0.0
        net, nvl = wire * remote, wire * (1.0 - remote)
        eff = 1e9 * gpu.comm_efficiency
        kind = "all-to-all" if op.kind == "ragged-all-to-all" else op.kind
        secs, _algorithm, _protocol = nccl.collective_seconds(kind, max(op.group_size, 2), nodes, net, nvl,
                                                              gpu.net_gbps * eff, gpu.nvlink_gbps * eff)
        out.append((op, secs + gpu.collective_latency_us * 1e-6, net, nvl, dispatch or layout.on_critical_path(axes)))
    return out


def _node_spread(op, node_of: np.ndarray) -> tuple[int, float]:
    """(the most nodes one replica group spans; of what one device sends in an all-to-all, an equal share to each
    of its n - 1 peers, the largest part that goes to other nodes: its off-node peers over n - 1)."""
    if op.kind == "collective-permute":
        return 2, 1.0
    groups = op.groups if op.groups is not None else np.arange(len(node_of))[None]
    nodes, remote = 1, 0
    for grp in groups:
        on = node_of[[g for g in grp if 0 <= g < len(node_of)]]
        nodes = max(nodes, len(set(on.tolist())))
        remote = max([remote] + [int((on != nd).sum()) for nd in set(on.tolist())])
    return nodes, remote / max(op.group_size - 1, 1)


def _comm(cfg: Config, layout: Layout, gpu: GpuSpec, ops: list, node_of: np.ndarray, moe_gemm: str) -> dict:
    """Collective seconds per step: exposed (critical path by axes), overlappable, by kind; wire bytes by link."""
    out = {"exposed": 0.0, "overlappable": 0.0, "by_link": {"nvlink": 0.0, "network": 0.0}, "per_kind": {}}
    for op, secs, net, nvl, critical in collective_timing(cfg, layout, gpu, ops, node_of, moe_gemm):
        if not secs:
            continue
        out["by_link"]["network"] += net * op.count
        out["by_link"]["nvlink"] += nvl * op.count
        out["exposed" if critical else "overlappable"] += secs * op.count
        out["per_kind"][op.kind] = out["per_kind"].get(op.kind, 0.0) + secs * op.count
    return out


def roofline(cfg: Config, layout: Layout, gpu: GpuSpec, ops: list, num_gpus: int,
             node_of: Optional[np.ndarray] = None, moe_gemm: str = "as_compiled",
             expert_flops: Optional[float] = None) -> dict:
    """The predicted step (module doc). MoE: the routed experts as compiled (``expert_flops`` from the HLO)
    or with a grouped-GEMM kernel (``moe_gemm='grouped'``, Megatron's active count)."""
    if node_of is None:
        node_of = np.arange(num_gpus) // gpu.gpus_per_node
    mf_full, mf_causal = model_flops(cfg, "full"), model_flops(cfg, "causal")
    hw_flops = hardware_flops_per_device(cfg, layout, moe_gemm, expert_flops)
    peak = gpu.peak_tflops * 1e12
    compute_s = compute_seconds(cfg, layout, gpu, hw_flops, moe_gemm, expert_flops)
    memory_s = hbm_bytes(cfg, layout, moe_gemm) / (gpu.hbm_gbps * 1e9)
    kernel_s = compute_s + memory_s
    c = _comm(cfg, layout, gpu, ops, node_of, moe_gemm)
    step = kernel_s + c["exposed"] + max(0.0, c["overlappable"] - kernel_s)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {
        "step_time_s": step, "compute_s": compute_s, "hbm_s": memory_s, "exposed_comm_s": c["exposed"],
        "overlappable_comm_s": c["overlappable"], "comm_s_by_kind": c["per_kind"],
        "wire_bytes_by_link": c["by_link"],
        "mfu": mf_full / (num_gpus * peak * step), "mfu_causal": mf_causal / (num_gpus * peak * step),
        "model_flops_per_step": mf_full, "model_flops_per_step_causal": mf_causal,
        "hardware_flops_per_device": hw_flops,
        "fp8_flops_per_device": fp8_flops_per_device(cfg, layout, moe_gemm, expert_flops),
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_gpu": tokens / step / num_gpus,
        "moe_gemm": moe_gemm if moe_layer_count(cfg.model) else None,
    }


def closed_form_comm_s(cfg: Config, layout: Layout, gpu: GpuSpec, num_gpus: int,
                       moe_gemm: str = "as_compiled") -> float:
    """Rough communication time for ranking search candidates before compiling."""
    m, s = cfg.model, cfg.data.seq_len
    t, f, st = layout.tp, layout.zero_shards, layout.stages
    d = layout.dp // f
    b, accum = layout.micro_batch_size, layout.accumulation_steps
    per_node = gpu.gpus_per_node
    bw = lambda span: (gpu.nvlink_gbps if span <= per_node else gpu.net_gbps) * 1e9 * gpu.comm_efficiency
    n = param_count(m) / st  # a pipeline stage holds, gathers and reduces 1/S of the layers
    secs = 0.0
    if t > 1:
        act = b * s * m.hidden_size * 2
        n_ar = m.num_layers / st * (6 if m.remat == "full" else 4) * accum
        secs += n_ar * 2 * act * (t - 1) / t / bw(t)
    if f > 1:
        gathers = 1 if gathers_stage_once(cfg, layout) else accum
        exposed_fsdp = gathers * (2 * 2 * n / t * (f - 1) / f + 2 * n / t * (f - 1) / f) / bw(f * t)
        secs += max(0.0, exposed_fsdp - 0.8 * model_flops(cfg, "causal") / num_gpus / (gpu.peak_tflops * 1e12 * gpu.compute_efficiency))
    if d > 1:
        secs += 2 * 4 * n / (f * t) * (d - 1) / d / bw(num_gpus)
    if moe_layer_count(m) and pmoe.expert_parallel(cfg, layout):  # the exchange, whatever the GEMM
        secs += pmoe.dispatch_comm_bytes(cfg, layout) / bw(layout.expert * layout.context * t)
    elif moe_layer_count(m) and moe_gemm == "as_compiled":
        secs += pmoe.dispatch_comm_bytes(cfg, layout) / bw(layout.dp * t)
    return secs


def gathers_stage_once(cfg: Config, layout: Layout) -> bool:
    """Whether each pipeline stage's weights are all-gathered over fsdp once per step (not per micro batch)."""
    return cfg.parallel.pipeline_fsdp_gather_once and layout.stages > 1 and layout.zero_shards > 1


def closed_form_step_s(cfg: Config, layout: Layout, gpu: GpuSpec, num_gpus: int,
                       moe_gemm: str = "as_compiled") -> float:
    """Rough step time for ranking search candidates before compiling. Pipeline stages: the bubble's idle
    ticks, and with ``parallel.pipeline_recompute`` the stages' forward run again in the backward (unless
    remat=full already recomputes it)."""
    compute = compute_seconds(cfg, layout, gpu, hardware_flops_per_device(cfg, layout, moe_gemm), moe_gemm)
    if layout.stages > 1:
        again = cfg.parallel.pipeline_recompute and cfg.model.remat != "full"
        compute *= (4.0 / 3.0 if again else 1.0) / (1.0 - layout.bubble)
    return (compute + hbm_bytes(cfg, layout, moe_gemm) / (gpu.hbm_gbps * 1e9)
            + closed_form_comm_s(cfg, layout, gpu, num_gpus, moe_gemm))


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]

