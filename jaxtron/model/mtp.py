"""DeepSeek-V3 multi-token prediction (MTP; paper section 2.2, docs/mtp.md).

Module k (1..D) predicts token t+k+1 at position t from the previous depth's hidden state h_{k-1} (h_0: the main
model's last hidden state, before its final norm) and the embedding of token t+k:

    h'_k = eh_proj([enorm(emb(t+k)); hnorm(h_{k-1})])  ->  block  ->  h_k;   logits_k = head(norm(h_k))

The embedding and the LM head are the main model's (:class:`jaxtron.model.llama.Llama` owns the modules and
passes each its decoder block: dense, or MoE when the model is). The concatenation puts the embedding first,
as DeepSeek-V3's checkpoint was trained (vLLM's and Megatron's MTP layers read ``eh_proj`` that way).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model.layers import RMSNorm, Rope, param
from jaxtron.model.projection import Matmuls
from jaxtron.parallel.sharding import constrain, matmul_weight

# eh_proj [2 * hidden, hidden]: rows are the concatenated [embedding; hidden state] (replicated: the input is
# the whole residual width twice), columns the residual stream's hidden dim (FSDP-split like every "embed" dim)
EH_PROJ_NAMES = ("mtp_in", "embed")


class MTPModule(nnx.Module):
    """One MTP depth: ``enorm``, ``hnorm`` (RMSNorm), ``eh_proj`` [2d, d], ``block`` (a decoder block, given) and
    ``norm`` (its own final norm, HF's ``shared_head.norm``)."""

    def __init__(self, cfg: ModelConfig, block: nnx.Module, *, rngs: nnx.Rngs, matmuls: Matmuls):
        d, pd = cfg.hidden_size, jnp.dtype(cfg.param_dtype)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.eh_proj = param(rngs, (2 * d, d), EH_PROJ_NAMES, cfg.initializer_range, pd)
        self.block = block
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.matmuls = matmuls

    def __call__(self, h: jax.Array, emb: jax.Array, rope: Rope, segment_ids: Optional[jax.Array]):
        """``h`` [batch, seq, d] the previous depth's hidden state (before any final norm), ``emb`` the
        embeddings of the tokens this depth reads (token t+k at position t) -> (h_k before ``norm``, the
        block's MoE router stats or None)."""
        x = jnp.concatenate([self.enorm(emb), self.hnorm(h).astype(emb.dtype)], axis=-1)
        w = matmul_weight(self.eh_proj[...], EH_PROJ_NAMES).astype(x.dtype)
        x = constrain(self.matmuls.project("bsi,id->bsd", x, w), ("act_batch", "act_res_seq", "act_embed"))
        out = self.block(x, rope, segment_ids)
        return out if isinstance(out, tuple) else (out, None)
