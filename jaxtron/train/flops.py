"""Model FLOPs and MFU, following Megatron-LM's ``num_floating_point_operations`` (GQA + SwiGLU; MLA layers by
:func:`mla_attention_flops`).

Per token, forward, counting a multiply-add as 2 FLOPs (matmuls only, as Megatron does):

    QKV projections   2 * d * (h + 2 * kv) * hd
    scores and AV     2 * 2 * s * h * hd       (x 1/2 under the 'causal' convention)
    output projection 2 * h * hd * d
    SwiGLU MLP        2 * 3 * d * ffn
    logits            2 * d * vocab

per layer except the logits, and training = 3 x forward. Mixture-of-Experts layers (``model.moe``) count
the parameters a token is multiplied by, not all of them (Megatron's MoE formula, plus the router):

    router            2 * d * E
    routed experts    2 * 3 * d * expert_ffn * k      (top-k experts per token)
    shared experts    2 * 3 * d * shared_ffn * n_shared  (+ 2 * d for Qwen's shared-expert gate)

in place of the SwiGLU term; dense layers (first_dense_layers, the dense layers of a layer_freq group) keep it.
Each multi-token-prediction module (``model.mtp``, docs/mtp.md) adds its ``eh_proj`` (2 * 2d * d), one decoder
layer of the last layer's kind and one more logits term, as Megatron counts its MTP layers. Two conventions for
causal attention:
``full`` counts the s^2 term whole (Megatron's published tables, NeMo's 62.5% MFU figure) and ``causal``
halves it (Megatron's code today). jaxtron reports MFU under both.
"""

from __future__ import annotations

from jaxtron.config import ModelConfig, head_dim

# Dense bf16 peak TFLOP/s per device (no sparsity), from the vendors' data sheets.
PEAK_TFLOPS = {
    "h100": 989.0,   # H100 SXM
    "h200": 989.0,
    "h100 pcie": 756.0,
    "a100": 312.0,
    "l40s": 362.0,
    "b200": 2250.0,
    "gh200": 989.0,
}


def flops_per_token(m: ModelConfig, seq_len: int, causal_convention: str = "full") -> float:
    """Training FLOPs (forward + backward) per token."""
    if causal_convention not in ("full", "causal"):
        raise ValueError(f"causal_convention must be 'full' or 'causal', got {causal_convention!r}")
    d, h, kv, hd, f, v = (m.hidden_size, m.num_heads, m.num_kv_heads, head_dim(m), m.intermediate_size,
                          m.vocab_size)
    causal = 0.5 if causal_convention == "causal" else 1.0
    attn_scores = 2 * 2 * seq_len * h * hd * causal
    attn = 2 * d * (h + 2 * kv) * hd + attn_scores + 2 * h * hd * d
    if m.mla.kv_lora_rank:
        attn = mla_attention_flops(m, seq_len, causal)
    num_moe = moe_layer_count(m)
    dense_ffn = (m.num_layers - num_moe) * 2 * 3 * d * f
    # each MTP module: eh_proj [2d, d], a decoder layer of the last layer's kind and its own pass of the LM head
    mtp = m.mtp.num_layers * (2 * 2 * d * d + attn + (moe_ffn_flops(m) if num_moe else 2 * 3 * d * f) + 2 * d * v)
    return 3.0 * (m.num_layers * attn + dense_ffn + num_moe * moe_ffn_flops(m) + 2 * d * v + mtp)


def mla_attention_flops(m: ModelConfig, seq_len: int, causal: float = 1.0) -> float:
    """Forward FLOPs per token of one Multi-head Latent Attention layer (jaxtron/model/mla.py) as trained (the
    latent expanded into per-head keys and values): the query (low-rank when q_lora_rank > 0), the latent and
    the rope key, their expansion, scores over n + r channels, values of v, the output projection. ``causal``
    scales the s^2 terms (0.5 under the 'causal' convention)."""
    a, d, h = m.mla, m.hidden_size, m.num_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    query = 2 * (d * a.q_lora_rank + a.q_lora_rank * h * qk) if a.q_lora_rank else 2 * d * h * qk
    latent = 2 * d * (a.kv_lora_rank + a.qk_rope_head_dim)
    expand = 2 * a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    scores = 2 * seq_len * h * (qk + a.v_head_dim) * causal
    return query + latent + expand + scores + 2 * h * a.v_head_dim * d


def moe_layer_count(m: ModelConfig) -> int:
    e = m.moe
    return (m.num_layers - e.first_dense_layers) // e.layer_freq if e.num_experts else 0


def moe_ffn_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE layer's feed-forward block (active experts only)."""
    e, d = m.moe, m.hidden_size
    shared_ffn = e.num_shared_experts * (e.shared_expert_intermediate_size or e.expert_intermediate_size)
    return (2 * d * e.num_experts + 2 * 3 * d * e.expert_intermediate_size * e.num_experts_per_token
            + 2 * 3 * d * shared_ffn + (2 * d if e.shared_expert_gate and e.num_shared_experts else 0))


def device_peak_tflops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    best = None
    for name, peak in PEAK_TFLOPS.items():
        if name in kind and (best is None or len(name) > len(best[0])):
            best = (name, peak)
    return best[1] if best else None
