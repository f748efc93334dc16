"""The config schema's model section: :class:`ModelConfig` (``model.*``) and its sub-sections (RoPE scaling, MoE,
Multi-head Latent Attention, multi-token prediction), and the functions that resolve its ``auto`` fields for
the devices a program runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from jaxtron.config.fields import documented as _f


@dataclass
class RopeScalingConfig:
    type: str = _f("none", "'none', 'llama3' (Llama-3.1 frequency-dependent scaling) or 'yarn' (YaRN: DeepSeek-V3's "
                           "128K extension, Qwen's long-context configs), with transformers' math.")
    factor: float = _f(8.0, "llama3, yarn: how much the context is stretched.")
    low_freq_factor: float = _f(1.0, "llama3: wavelengths above original_max/low_freq_factor are scaled fully.")
    high_freq_factor: float = _f(4.0, "llama3: wavelengths below original_max/high_freq_factor are kept.")
    original_max_position_embeddings: int = _f(8192, "llama3, yarn: the context length the model was trained "
                                                      "with.")
    beta_fast: float = _f(32.0, "yarn: frequencies turning more than beta_fast times over "
                                "original_max_position_embeddings are kept as they are.")
    beta_slow: float = _f(1.0, "yarn: frequencies turning fewer than beta_slow times are divided by factor; those "
                               "between are blended on a linear ramp over the channel index.")
    mscale: float = _f(1.0, "yarn: only read when mscale_all_dim is set: the cos/sin tables are then multiplied "
                            "by (0.1 mscale ln factor + 1) / (0.1 mscale_all_dim ln factor + 1) (transformers' "
                            "attention_factor; 1 for DeepSeek-V3's mscale = mscale_all_dim); 0 = not set, as "
                            "for mscale_all_dim.")
    mscale_all_dim: float = _f(0.0, "yarn: 0 = not set: the cos/sin tables are multiplied by 0.1 ln factor + 1. "
                                    "Set (DeepSeek-V3: 1.0): the tables take mscale's ratio instead, and Multi-head "
                                    "Latent Attention's softmax scale is multiplied by (0.1 mscale_all_dim ln "
                                    "factor + 1)^2 (DeepSeek's yarn_get_mscale; not applied by other attention, "
                                    "as in transformers).")


@dataclass
class MoEConfig:
    num_experts: int = _f(0, "Routed experts per MoE layer; 0: a dense model (every layer a SwiGLU MLP).")
    num_experts_per_token: int = _f(2, "Top-k: experts each token is sent to.")
    expert_intermediate_size: int = _f(256, "SwiGLU hidden width of each routed expert (Megatron's "
                                            "moe_ffn_hidden_size).")
    num_shared_experts: int = _f(0, "Shared experts every token goes through (DeepSeek, Qwen2-MoE); they run as "
                                    "one SwiGLU of num_shared_experts * shared_expert_intermediate_size.")
    shared_expert_intermediate_size: Optional[int] = _f(None, "Hidden width of one shared expert; default "
                                                              "expert_intermediate_size.")
    shared_expert_gate: bool = _f(False, "Scale the shared experts' output by sigmoid(x . w) per token (Qwen2-MoE's "
                                         "shared_expert_gate).")
    first_dense_layers: int = _f(0, "The first N decoder layers keep the dense SwiGLU MLP (model.intermediate_size; "
                                    "DeepSeek's first_k_dense_replace).")
    layer_freq: int = _f(1, "Of the layers after first_dense_layers, every layer_freq-th is MoE and the others "
                            "dense (layer j counted from there is MoE when (j+1) % layer_freq == 0, Qwen's "
                            "decoder_sparse_step); num_layers - first_dense_layers must be a multiple of it.")
    score_func: str = _f("softmax", "Router scores: 'softmax' (Mixtral, Qwen-MoE) or 'sigmoid' (DeepSeek-V3).")
    norm_topk_prob: bool = _f(True, "Renormalize the top-k routing weights of a token to sum to 1.")
    routed_scaling_factor: float = _f(1.0, "Multiply the routed experts' output by this (DeepSeek-V3: 2.5).")
    n_group: int = _f(1, "Grouped top-k: experts split into this many groups (DeepSeek-V3: 8); 1 = plain top-k.")
    topk_group: int = _f(1, "Grouped top-k: a token picks its experts from its best topk_group groups (a group "
                            "scores the sum of its best two experts).")
    aux_free_bias: bool = _f(False, "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the "
                                    "scores for expert selection only (not to the weights), kept in the model "
                                    "state (checkpointed) and moved by bias_update_rate * sign(mean load - load) "
                                    "after every train step, without gradient.")
    bias_update_rate: float = _f(1e-3, "aux_free_bias: the step size of the bias update (DeepSeek-V3's gamma).")
    aux_loss_coef: float = _f(0.0, "Coefficient of the load-balancing loss E * sum_e f_e * P_e (Switch/Mixtral, "
                                   "over the whole (micro) batch) added to the training loss per MoE layer, "
                                   "averaged over the MoE layers.")
    z_loss_coef: float = _f(0.0, "Coefficient of the router z-loss mean(logsumexp(router logits)^2) added to the "
                                 "training loss (averaged over the MoE layers).")
    dispatch: str = _f("dropless", "'dropless': tokens sorted by expert, grouped matmuls (gmm_impl), "
                                   "none dropped; 'capacity': at most capacity_factor * tokens * k / experts "
                                   "tokens per expert, the rest dropped (their residual passes through), dense "
                                   "per-expert matmuls.")
    capacity_factor: float = _f(1.25, "capacity dispatch: expert capacity as a multiple of the balanced load.")
    gmm_impl: str = _f("auto", "dropless dispatch's grouped matmuls: 'ragged_dot' (jax.lax.ragged_dot; XLA:GPU "
                               "runs it by default as a masked dense matmul, E times the FLOPs), 'pallas' "
                               "(pallas_kernels.grouped_matmul, Triton; interpret mode on CPU: exact but slow; no "
                               "FP8: the routed experts stay in model.dtype) or 'auto' (pallas on GPUs, where it "
                               "measured 3-60x ragged_dot, docs/performance.md; ragged_dot elsewhere).")
    ep_dispatch: str = _f("all_to_all", "With parallel.expert > 1, how dropless dispatch sends tokens to their "
                                        "experts' ranks: 'all_to_all' (fixed per-rank buffers of "
                                        "ep_capacity_factor, jax.lax.all_to_all; any platform) or "
                                        "'ragged_all_to_all' (exact-size exchange into a receive buffer of "
                                        "ep_capacity_factor, jax.lax.ragged_all_to_all; GPUs only).")
    ep_capacity_factor: Optional[float] = _f(None, "all_to_all dispatch: rows per destination rank in each "
                                                   "device's send buffer as a multiple of the balanced share, "
                                                   "ceil(factor * tokens * k / parallel.expert); assignments "
                                                   "past it are dropped and counted in moe_dropped. null: the "
                                                   "worst case tokens * min(k, experts per rank), nothing "
                                                   "dropped (buffers parallel.expert times the balanced size). "
                                                   "ragged_all_to_all: each device's receive buffer is "
                                                   "parallel.expert times that, filled in sender order; rows "
                                                   "past it are dropped and counted.")
    ep_overlap: bool = _f(False, "all_to_all dispatch: each device's tokens in two chunks pipelined by their data "
                                 "dependencies (chunk 1's dispatch issued before chunk 0's expert matmuls, chunk "
                                 "0's return before chunk 1's), so that XLA can run each exchange under the other "
                                 "chunk's experts. Each chunk gets buffers of ep_capacity_factor of its own "
                                 "tokens.")


@dataclass
class MLAConfig:
    kv_lora_rank: int = _f(0, "Multi-head Latent Attention (DeepSeek-V2/V3; docs/mla.md): width of the compressed "
                              "key/value latent each token caches; 0: standard (GQA) attention.")
    q_lora_rank: int = _f(0, "MLA: width of the compressed query latent (DeepSeek-V3: 1536); 0: queries projected "
                             "from the hidden state directly (DeepSeek-V2-Lite).")
    qk_nope_head_dim: int = _f(128, "MLA: per-head query/key width without rotary embedding.")
    qk_rope_head_dim: int = _f(64, "MLA: per-head query/key width with rotary embedding (the key's rotary part "
                                   "is one head shared by all query heads).")
    v_head_dim: int = _f(128, "MLA: per-head value width.")


@dataclass
class MTPConfig:
    num_layers: int = _f(0, "Multi-token prediction (DeepSeek-V3; docs/mtp.md): depth D of the MTP modules, "
                            "module k predicting token t+k+1 from the main model's hidden state and token t+k; "
                            "each module is a projection and a decoder block sharing the embedding and the LM "
                            "head; 0: none.")
    loss_coef: float = _f(0.1, "Weight of the MTP loss (the mean of the D modules' cross entropies) added to the "
                               "training loss (DeepSeek-V3: 0.3 early, then 0.1); logged apart as mtp_loss.")


@dataclass
class ModelConfig:
    vocab_size: int = _f(256, "Vocabulary size (rows of the embedding table).")
    hidden_size: int = _f(256, "Model width d_model.")
    num_layers: int = _f(4, "Number of decoder blocks (stacked and scanned).")
    num_heads: int = _f(4, "Query heads.")
    num_kv_heads: int = _f(2, "Key/value heads (GQA: num_heads % num_kv_heads == 0; 1 = MQA).")
    head_dim: Optional[int] = _f(None, "Per-head width; default hidden_size // num_heads.")
    intermediate_size: int = _f(512, "SwiGLU hidden width (ffn_hidden_size).")
    rope_theta: float = _f(10000.0, "RoPE base frequency.")
    rope_scaling: RopeScalingConfig = _f(doc="RoPE frequency scaling.", factory=RopeScalingConfig)
    rms_norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = _f(False, "Share the token embedding with the LM head.")
    loss_chunk_tokens: int = _f(0, "Compute the LM head and the fp32 cross entropy (and z-loss) about this many "
                                   "tokens per device at a time, in a loop whose backward recomputes one chunk's "
                                   "logits at a time, so no step holds the logits of a whole micro batch "
                                   "(MaxText's num_vocab_tiling); a chunk's logits take loss_chunk_tokens x "
                                   "vocab_size / parallel.tensor x 4 bytes. The head is gathered over FSDP once "
                                   "per micro batch and its fp32 gradient accumulated whole. 0: off, the whole "
                                   "micro batch's logits at once. Same loss and gradients up to fp32 rounding. "
                                   "Off by default: on Llama-3-8B, fsdp 8, micro batch 1 x 8192 the planner "
                                   "predicts 8192-token chunks 1% slower at the same peak memory.")
    qkv_bias: bool = _f(False, "Bias on the Q/K/V projections (Qwen2).")
    qk_norm: bool = _f(False, "RMSNorm over head_dim of every query and key head before RoPE, with weights "
                              "[head_dim] shared by the heads and eps rms_norm_eps (Qwen3).")
    initializer_range: float = _f(0.02, "Std of the normal init; output projections use std/sqrt(2*num_layers).")
    attention_impl: str = _f("xla", "Attention: 'xla' (reference, any device), 'cudnn' (GPU), 'pallas' (jaxtron's "
                                    "flash attention; GPU, or interpret mode on CPU: exact but slow) or 'mosaic' "
                                    "(its Mosaic GPU kernels for Hopper; bf16/fp16, head_dim "
                                    "64 or 128; on CPU interpreted with jax >= 0.11).")
    deterministic_attention: bool = _f(False, "Bitwise-reproducible attention gradients: 'mosaic' then computes dq "
                                              "in a kernel of its own instead of reduce-adding it from the dk/dv "
                                              "kernel (seven matmuls per block pair, not five); 'xla' and "
                                              "'pallas' always are; 'cudnn' is refused.")
    rope_impl: str = _f("xla", "Rotary embedding: 'xla' or 'pallas' (fused q/k kernel; interpret mode on CPU).")
    mlp_impl: str = _f("xla", "SwiGLU activation: 'xla' or 'pallas' (fused kernel; interpret mode on CPU).")
    check_kernels: bool = _f(True, "On GPUs, before compiling the train step, run each selected Pallas/Mosaic "
                                   "kernel forward and backward on a small problem against the XLA reference "
                                   "and stop with an error naming the field if it disagrees "
                                   "(jaxtron/model/kernel_check.py).")
    fp8: str = _f("none", "FP8 matmuls for the decoder's dense projections (QKV, attention output, gate/up, "
                          "down, shared experts; jaxtron/model/fp8.py): 'none', 'current' (each tensor scaled by "
                          "its own amax in this step), 'delayed' (scaled by the max amax of the last "
                          "fp8_amax_history steps, kept as checkpointed model state), both with e4m3 operands and "
                          "e5m2 gradients, or 'blockwise' (DeepSeek-V3's fine-grained scaling, all e4m3: a scale "
                          "per 1 x fp8_block tile of activations and gradients and per fp8_block^2 tile of weights; "
                          "jaxtron/model/fp8_blockwise.py). Routed MoE experts under gmm_impl=ragged_dot run in FP8 "
                          "with current scaling under any recipe. Embedding, LM head, norms, attention and router "
                          "stay in model.dtype.")
    fp8_block: int = _f(128, "model.fp8=blockwise: the tile size B (a power of two >= 16); hidden size, the "
                             "per-device widths of heads x head_dim and the MLP, and data.seq_len / "
                             "parallel.context must be multiples of it.")
    fp8_blockwise_impl: str = _f("auto", "model.fp8=blockwise: the block-scaled GEMMs: 'pallas' (the Triton "
                                         "kernel, per device; interpret mode on CPU), 'xla' (its jnp reference: "
                                         "the same sums in XLA ops, no FP8 speed-up on GPUs) or 'auto' (pallas "
                                         "on GPUs, xla elsewhere).")
    fp8_amax_history: int = _f(16, "model.fp8=delayed: steps of amax history per tensor (Transformer Engine's "
                                   "amax_history_len).")
    fp8_margin: int = _f(0, "model.fp8=delayed: scales are amax * 2^margin / format max (headroom for growth).")
    remat: str = _f("none", "Activation recomputation per block: 'none', 'full', 'save_dots' (selective), "
                            "'save_dots_attention' (save_dots and the flash kernel's residuals), or a named policy "
                            "saving (save_*) or offloading to host (offload_*) chosen activations: "
                            "save_qkv_proj, save_attention_out, save_qkv_attention, save_mlp_io, save_named, "
                            "offload_qkv_attention, offload_named (jaxtron/model/remat.py).")
    scan_unroll: int = _f(1, "Decoder blocks per iteration of the layer scan (1: rolled). Unrolling lets XLA fuse "
                             "across blocks and, inside a pipeline tick's checkpoint, merge the blocks' own "
                             "recomputation with the tick's; compile time grows with it.")
    dtype: str = _f("auto", "Compute dtype for matmuls and activations; 'auto': bfloat16 on GPU/TPU, float32 on "
                            "CPU (where bf16 elementwise ops are emulated and slower).")
    param_dtype: str = _f("float32", "Master weight dtype (optimizer state follows it).")
    moe: MoEConfig = _f(doc="Mixture-of-Experts feed-forward layers (docs/moe.md); num_experts=0: dense.",
                        factory=MoEConfig)
    mla: MLAConfig = _f(doc="Multi-head Latent Attention (docs/mla.md); kv_lora_rank=0: standard attention.",
                        factory=MLAConfig)
    mtp: MTPConfig = _f(doc="Multi-token prediction modules (docs/mtp.md); num_layers=0: none.",
                        factory=MTPConfig)


def compute_dtype(m: ModelConfig) -> str:
    """The resolved compute dtype name ('auto' -> bfloat16 on accelerators, float32 on CPU)."""
    if m.dtype != "auto":
        return m.dtype
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def gmm_impl(m: ModelConfig, gpu: bool) -> str:
    """The resolved ``model.moe.gmm_impl`` for a program on GPUs (``gpu``) or other devices ('auto' -> pallas
    for dropless dispatch on GPUs, ragged_dot elsewhere: capacity dispatch has no grouped matmul)."""
    if m.moe.gmm_impl != "auto":
        return m.moe.gmm_impl
    return "pallas" if gpu and m.moe.dispatch == "dropless" else "ragged_dot"


def head_dim(m: ModelConfig) -> int:
    return m.head_dim if m.head_dim is not None else m.hidden_size // m.num_heads
