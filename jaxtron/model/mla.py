"""Multi-head Latent Attention (DeepSeek-V2/V3; docs/mla.md), selected by ``model.mla.kv_lora_rank > 0``.

Keys and values are not projected from the hidden state per head: each token is compressed into one latent of
``kv_lora_rank`` (c) channels (``wkv_a``, then ``kv_norm``) and one rotary key of ``qk_rope_head_dim`` (r)
channels shared by every head (``wk_rope``, then RoPE). Head h's key is ``[latent @ wk_b[:, h], k_rope]``
(``qk_nope_head_dim`` (n) + r channels) and its value ``latent @ wv_b[:, h]`` (``v_head_dim``, v). Queries are
``wq`` (``q_lora_rank`` = 0) or ``wq_b(q_norm(wq_a x))`` (a low-rank query, DeepSeek-V3), their last r channels
rotated. The softmax scale is (n + r)^-0.5 (with YaRN's mscale_all_dim, times its temperature squared:
:attr:`LatentAttention.scale`). The math is that of transformers' ``DeepseekV3Attention``.

Training (and any uncached forward) expands the latent into per-head keys and values and runs the model's
attention (:func:`jaxtron.model.attention.attention`, or the context-parallel
:func:`jaxtron.parallel.ring_attention.sequence_attention`), so tensor and context parallelism work as for
:class:`~jaxtron.model.layers.Attention`. The 'xla' implementation and the ring take values narrower than the
keys as they are; the kernels ('pallas', 'mosaic', 'cudnn') need equal widths, so for them v is zero-padded to
n + r (and for the Triton kernel, which takes powers of two, q, k and v to
:func:`jaxtron.model.kernels.padded_head_dim`) and the output
sliced back (exact: zero channels change no score, and the padded output channels are dropped).

Decoding caches only the latent [b, T, c] and the rotated key [b, T, r] per layer (the cache's ``k`` and ``v``:
:mod:`jaxtron.model.cache`) and attends in the absorbed form: the query's no-rope part is taken into latent
space through ``wk_b`` (q_lat = q_nope @ wk_b^T, [b, s, h, c]), scores are q_lat . latent + q_rope . k_rope,
the probabilities average the latents, and ``wv_b`` maps the result to each head's value space, so no per-head
key or value is ever built for the cache.

RoPE: jaxtron rotates in the rotate-half layout. DeepSeek's checkpoints (``rope_interleave: true``, transformers'
default) rotate interleaved pairs (x0, x1), (x2, x3), ...; that equals rotate-half applied to the channels
reordered evens first, then odds (transformers' ``apply_rotary_pos_emb_interleave`` returns that order), and
scores do not depend on an order q and k share. A converter therefore reorders the rope outputs of the query
projection (per head) and of the rope key projection with :func:`rope_deinterleave_order`.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model import fp8, kernels, remat
from jaxtron.model.attention import attention, xla_attention
from jaxtron.model.cache import LATENT_CACHE_NAMES, ROPE_KEY_CACHE_NAMES, LayerCache
from jaxtron.model.layers import RMSNorm, Rope, param, rope_attention_factor, rope_tables, rotate, yarn_mscale
from jaxtron.model.projection import Matmuls
from jaxtron.parallel import ring_attention
from jaxtron.parallel.sharding import constrain, matmul_weight

HEADS = ("act_batch", "act_seq", "act_heads", "act_head_dim")
Q_LATENT = ("act_batch", "act_seq", "act_q_lora")
KV_LATENT = ("act_batch", "act_seq", "act_kv_lora")
ROPE_KEY = ("act_batch", "act_seq", None, "act_head_dim")  # the one shared rotary key head


def rope_deinterleave_order(r: int) -> np.ndarray:
    """The channel order that turns an interleaved-pair RoPE weight into jaxtron's rotate-half one: new channel
    i is old channel ``order[i]`` (0, 2, 4, ..., 1, 3, 5, ...). Apply it to the rope output channels of
    transformers' ``q_b_proj``/``q_proj`` (each head's last r rows) and ``kv_a_proj_with_mqa`` (its last r rows)
    when the checkpoint has ``rope_interleave: true``."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


# DeepSeek's latent norms (its reference code and transformers' DeepseekV3) use 1e-6 whatever the model's
# rms_norm_eps, so a checkpoint's logits match only with this epsilon.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    """MLA with :class:`~jaxtron.model.layers.Attention`'s call: ``(x, rope, segment_ids)`` -> [b, s, hidden];
    with ``cache`` (decoding) it returns ``(out, (latent cache, rope key cache))``. Parameters (logical names):
    ``wq_a`` [d, q] (embed, q_lora), ``q_norm`` [q], ``wq_b`` [q, h, n+r] (q_lora, heads, head_dim) when
    ``q_lora_rank`` > 0, else ``wq`` [d, h, n+r] (embed, heads, head_dim); ``wkv_a`` [d, c] (embed, kv_lora),
    ``wk_rope`` [d, r] (embed, head_dim), ``kv_norm`` [c], ``wk_b`` [c, h, n] and ``wv_b`` [c, h, v] (kv_lora,
    heads, head_dim), ``wo`` [h, v, d] (heads, head_dim, embed)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Optional[Matmuls] = None):
        m = cfg.mla
        d, h = cfg.hidden_size, cfg.num_heads
        n, r, v, c, q = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
        pd = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.cfg = cfg
        self.dims = (n, r, v)
        if q > 0:
            self.wq_a = param(rngs, (d, q), ("embed", "q_lora"), std, pd)
            self.q_norm = RMSNorm(q, LATENT_NORM_EPS, param_dtype=pd, rngs=rngs)
            self.wq_b = param(rngs, (q, h, n + r), ("q_lora", "heads", "head_dim"), std, pd)
        else:
            self.wq = param(rngs, (d, h, n + r), ("embed", "heads", "head_dim"), std, pd)
        self.wkv_a = param(rngs, (d, c), ("embed", "kv_lora"), std, pd)
        self.wk_rope = param(rngs, (d, r), ("embed", "head_dim"), std, pd)
        self.kv_norm = RMSNorm(c, LATENT_NORM_EPS, param_dtype=pd, rngs=rngs)
        self.wk_b = param(rngs, (c, h, n), ("kv_lora", "heads", "head_dim"), std, pd)
        self.wv_b = param(rngs, (c, h, v), ("kv_lora", "heads", "head_dim"), std, pd)
        self.wo = param(rngs, (h, v, d), ("heads", "head_dim", "embed"), out_std, pd)
        self.matmuls = matmuls or Matmuls.here()
        self.recipe = fp8.Recipe.of(cfg, self.matmuls)
        weights = (("wq_a", "wq_b") if q > 0 else ("wq",)) + ("wkv_a", "wk_rope", "wk_b", "wv_b", "wo")
        self.recipe.add_histories(self, weights)

    @property
    def scale(self) -> float:
        """The softmax scale (n + r)^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 when YaRN's mscale_all_dim is
        set (DeepSeek's temperature, transformers' ``yarn_apply_mscale``): every score, rope and no-rope part
        alike, in training and in the absorbed decode."""
        n, r, _ = self.dims
        rs = self.cfg.rope_scaling
        if rs.type == "yarn" and rs.mscale_all_dim:
            return (n + r) ** -0.5 * yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return (n + r) ** -0.5

    def __call__(self, x, rope: Rope, segment_ids, cache: Optional[LayerCache] = None):
        n, r, _ = self.dims
        q = self._queries(x)                                                    # [b, s, h, n + r]
        latent = self.recipe.project(self, "wkv_a", "bsd,dc->bsc", x, c="act_kv_lora")
        latent = self.kv_norm(remat.tag(constrain(latent, KV_LATENT), remat.QKV[1]))  # [b, s, c]
        k_rope = self.recipe.project(self, "wk_rope", "bsd,dk->bsk", x)[:, :, None]   # [b, s, 1, r]
        k_rope = remat.tag(constrain(k_rope, ROPE_KEY), remat.QKV[1])
        q_nope, q_rope = q[..., :n], q[..., n:]
        cos, sin = ((rope.cos, rope.sin) if rope.cos is not None else
                    rope_tables(rope.positions, rope.inv_freq, rope_attention_factor(self.cfg)))
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope, cos, sin)
        if cache is not None:
            return self._attend_cache(q_nope, q_rope, latent, k_rope[:, :, 0], cache)
        k_nope = self.recipe.project(self, "wk_b", "bsc,chk->bshk", latent, c="act_kv_lora")
        v = self.recipe.project(self, "wv_b", "bsc,chk->bshk", latent, c="act_kv_lora")
        k_nope = remat.tag(constrain(k_nope, HEADS), remat.QKV[1])
        v = remat.tag(constrain(v, HEADS), remat.QKV[2])
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), HEADS)
        k = constrain(jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], r))], axis=-1),
                      HEADS)
        out = self._attend(q, k, v, rope, segment_ids)
        out = remat.tag(constrain(out, HEADS), remat.ATTENTION_OUT)
        return remat.tag(self.recipe.project(self, "wo", "bshk,hkd->bsd", out), remat.OUT_PROJ)

    def _queries(self, x):
        if self.cfg.mla.q_lora_rank > 0:
            ql = self.recipe.project(self, "wq_a", "bsd,dq->bsq", x, q="act_q_lora")
            ql = self.q_norm(constrain(ql, Q_LATENT))
            q = self.recipe.project(self, "wq_b", "bsq,qhk->bshk", remat.tag(ql, remat.QKV[0]), q="act_q_lora")
        else:
            q = self.recipe.project(self, "wq", "bsd,dhk->bshk", x)
        return remat.tag(constrain(q, HEADS), remat.QKV[0])

    def _attend(self, q, k, v, rope: Rope, segment_ids):
        """Causal attention of q, k [b, s, h, n+r] and v [b, s, h, v] -> [b, s, h, v]."""
        impl, vd = self.cfg.attention_impl, v.shape[-1]
        if impl != "xla":  # the kernels need v as wide as q and k (the Triton one a power of two): pad, slice back
            width = kernels.padded_head_dim(q.shape[-1], impl)
            pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, width - a.shape[-1])))  # noqa: E731
            q, k, v = pad(q), pad(k), pad(v)
        if impl in ("xla", "pallas"):  # as Attention: the rules say how a sequence split over 'context' is read
            flash, attend = None, lambda q, k, v, seg, scale, pos: xla_attention(q, k, v, seg, scale, pos,  # noqa: E731
                                                                                 matmuls=self.matmuls)
            if impl == "pallas":
                flash = kernels.flash_piece(self.scale)
                attend = lambda q, k, v, seg, scale, _: attention(q, k, v, seg, implementation="pallas",  # noqa: E731
                                                                  scale=scale)
            out = ring_attention.sequence_attention(q, k, v, segment_ids, rope.positions, self.scale, attend, flash)
        else:
            out = attention(q, k, v, segment_ids, implementation=impl, scale=self.scale,
                            deterministic=self.cfg.deterministic_attention, matmuls=self.matmuls)
        return out[..., :vd]

    def _attend_cache(self, q_nope, q_rope, latent, k_rope, cache: LayerCache):
        """The absorbed form against the cache: ``cache.k`` [b, T, c] latents, ``cache.v`` [b, T, r] rotated
        keys. Under an FP8 recipe the absorbed products with wk_b/wv_b run in the compute dtype."""
        dt = q_nope.dtype
        write = lambda buf, x, names: constrain(  # noqa: E731
            jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), (0, cache.index, 0)), names)
        latents, keys = write(cache.k, latent, LATENT_CACHE_NAMES), write(cache.v, k_rope, ROPE_KEY_CACHE_NAMES)
        weight = lambda name: matmul_weight(getattr(self, name)[...].astype(dt),  # noqa: E731
                                            ("kv_lora", "heads", "head_dim"))
        q_lat = constrain(self.matmuls.project("bshn,chn->bshc", q_nope, weight("wk_b")),
                          ("act_batch", "act_seq", "act_heads", "act_kv_lora"))
        out_lat = absorbed_attention(q_lat, q_rope, latents.astype(dt), keys.astype(dt), cache.mask, self.scale,
                                     self.matmuls)
        out = constrain(self.matmuls.project("bshc,chv->bshv", out_lat, weight("wv_b")), HEADS)
        return self.recipe.project(self, "wo", "bshk,hkd->bsd", out), (latents, keys)


def absorbed_attention(q_lat, q_rope, latents, keys, mask, scale: float, matmuls: Matmuls = Matmuls()):
    """q_lat [b, s, h, c] (no-rope queries in latent space), q_rope [b, s, h, r]; latents [b, T, c], keys
    [b, T, r] (the whole cache); mask [b, s, T] -> the attention-weighted latents [b, s, h, c]. Softmax in fp32."""
    scores = (matmuls.contract("bshc,btc->bhst", q_lat, latents, jnp.float32)
              + matmuls.contract("bshr,btr->bhst", q_rope, keys, jnp.float32)) * scale
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(latents.dtype)
    return matmuls.contract("bhst,btc->bshc", probs, latents, jnp.float32).astype(q_lat.dtype)
