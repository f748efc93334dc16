"""Flash attention that also returns its log-sum-exp, differentiable through both: the piece that attention split
into parts (context parallelism's ring and gathered blocks) merges by.

Public API:
  flash_attention_lse(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None, softmax_scale=None,
                      interpret=None, **blocks) -> (out [b, s, h, d] in q.dtype, lse [b, h, s] fp32)
  flash_attention_lse_reference(...) -> the same in plain jnp

q and k/v are equally long but may be different pieces of a sequence: ``segment_ids`` are the queries' document
ids and ``kv_segment_ids`` the keys' (default: the same row); causal masks by index within the piece pair, so a
caller passes ``causal=False`` for a key piece wholly before the query piece. lse is the natural-log
log-sum-exp of each query row's visible scaled logits, -inf for a row that sees no key (its output is 0). Two
results over disjoint key sets merge exactly: lse = logaddexp(lse1, lse2), out = exp(lse1 - lse) out1 +
exp(lse2 - lse) out2. The gradient through lse needs no other kernel: d lse_i / d logit_ij = p_ij, so the
backward's delta = rowsum(dO * O) becomes delta - d lse (`flash_attention._flash_bwd`). Triton backend only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .flash_attention import flash_bwd, flash_fwd, prepare

__all__ = ["flash_attention_lse", "flash_attention_lse_reference"]

_LN2 = math.log(2.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_lse(q, k, v, seg, cfg):
    return _flash_lse_fwd(q, k, v, seg, cfg)[0]


def _flash_lse_fwd(q, k, v, seg, cfg):
    out, res = flash_fwd(q, k, v, seg, cfg)
    return (out, res[5]), res                     # res[5]: the log2-domain lse [b, h, s_pad]


def _flash_lse_bwd(cfg, res, cotangents):
    do, dlse = cotangents
    return flash_bwd(cfg, res, do, dlse)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def flash_attention_lse(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None,
                        softmax_scale=None, interpret: bool | None = None, block_q: int | None = None,
                        block_k: int | None = None, block_q_bwd: int | None = None, block_k_bwd: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None):
    """(out, lse) of attention of q over k, v; see the module docstring. Differentiable in q, k, v through both."""
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' ids)")
    q, k, v, seg, cfg = prepare(
        q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale, sliding_window=None, block_q=block_q, block_k=block_k,
        block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd, num_warps=num_warps, num_stages=num_stages,
        num_warps_bwd=None, num_stages_bwd=None, interpret=interpret, backend="triton", fuse_dq=None)
    out, lse2 = _flash_lse(q, k, v, seg, cfg)
    s = cfg.seq_len
    lse2 = lse2[:, :, :s]
    lse = jnp.where(jnp.isinf(lse2), -jnp.inf, lse2 * jnp.float32(_LN2))   # the kernel marks empty rows +inf
    return out[:, :s], lse


def flash_attention_lse_reference(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None,
                                  softmax_scale=None):
    """Plain jnp (fp32 softmax): the same (out, lse) as `flash_attention_lse`."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    scale = (1.0 / math.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    hp = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(b, s, kvh, h // kvh, d)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qf, k.astype(jnp.float32), precision=hp) * scale
    mask = jnp.tril(jnp.ones((s, s), bool)) if causal else jnp.ones((s, s), bool)
    mask = jnp.broadcast_to(mask, (b, s, s))
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, :, None] == kv_ids[:, None, :])
    mask = mask[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.scipy.special.logsumexp(logits, axis=-1)                              # -inf for an empty row
    p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32), precision=hp)
    return out.reshape(b, s, h, d).astype(q.dtype), lse.reshape(b, h, s)
