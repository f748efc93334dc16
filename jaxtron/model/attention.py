"""Attention dispatch: 'xla' (plain jnp reference, any device), 'cudnn' (jax.nn.dot_product_attention),
'pallas' (``pallas_kernels.flash_attention`` through :mod:`jaxtron.model.kernels`, run per shard: batch and heads split as the rules say, the
sequence whole) or 'mosaic' (the same with ``backend="mosaic"``: the Mosaic GPU kernels for Hopper).

q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]; causal; ``segment_ids``
[batch, seq] (equal ids attend to each other: packed documents) or None. Softmax statistics are fp32.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxtron.model import kernels
from jaxtron.model.projection import Matmuls
from jaxtron.model.remat import ATTENTION_KERNEL, tag


def xla_attention(q, k, v, segment_ids: Optional[jax.Array], scale: float,
                  positions: Optional[jax.Array] = None, *, matmuls: Matmuls = Matmuls()) -> jax.Array:
    """The scores and values are ``matmuls``' contractions (the model's: jaxtron/model/projection.py). With
    ``positions`` [batch, seq] and ``segment_ids``, the causal mask compares positions (key not after query, same
    segment) instead of indices: sequences may come in another order than their positions'
    (context parallelism's load balance). Positions must increase along each segment, as the loader makes them."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, s, kvh, g, d)  # GQA without repeating K/V
    scores = matmuls.contract("bqkgd,bskd->bkgqs", qg, k, jnp.float32) * scale
    if positions is None or segment_ids is None:
        mask = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))[None, None, None]
    else:
        mask = (positions[:, :, None] >= positions[:, None, :])[:, None, None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = matmuls.contract("bkgqs,bskd->bqkgd", probs, v, jnp.float32)
    return out.reshape(b, s, h, v.shape[-1]).astype(q.dtype)  # v may be narrower than q and k (MLA)


def cached_attention(q, k, v, mask, scale: float, matmuls: Matmuls = Matmuls()) -> jax.Array:
    """Decoding against a KV cache: q [b, s, h, d]; k, v [b, T, kvh, d] (the whole cache); mask [b, s, T]. The
    math of :func:`xla_attention` with an explicit mask (the flash kernels are causal square kernels, so a
    cached step runs this for every ``attention_impl``)."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, d)
    scores = matmuls.contract("bqkgd,bskd->bkgqs", qg, k, jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = matmuls.contract("bkgqs,bskd->bqkgd", probs, v, jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)


def cudnn_attention(q, k, v, segment_ids: Optional[jax.Array], scale: float) -> jax.Array:
    mask = None
    if segment_ids is not None:  # cuDNN has no segment ids: a dense mask is correct but slower
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                        implementation="cudnn")


def pallas_attention(q, k, v, segment_ids: Optional[jax.Array], scale: float, backend: str = "triton",
                     **kernel_kw) -> jax.Array:
    return kernels.flash_attention(q, k, v, segment_ids, scale, backend, **kernel_kw)


def mosaic_attention(q, k, v, segment_ids: Optional[jax.Array], scale: float, deterministic: bool = False):
    """deterministic: dq from its own kernel rather than reduce-added from the dk/dv kernel (whose fp32 sum order
    varies between runs)."""
    return pallas_attention(q, k, v, segment_ids, scale, backend="mosaic", fuse_dq=not deterministic)


def residuals_named(kernel):
    """``kernel(q, k, v, segment_ids) -> out`` with the residuals its backward reads tagged
    :data:`~jaxtron.model.remat.ATTENTION_KERNEL`, so that a remat policy can keep them. A kernel's forward is a
    custom call (no dot): under ``save_dots`` the backward runs it again, for the softmax statistics the output
    alone does not give. The residuals are the leaves of ``jax.vjp``'s pullback, whichever kernel it is (cuDNN's
    from JAX, or ours); the numbers are the kernel's own."""
    @jax.custom_vjp
    def run(q, k, v, segment_ids):
        return kernel(q, k, v, segment_ids)

    def forward(q, k, v, segment_ids):
        out, pullback = jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids), q, k, v)
        return out, tag(pullback, ATTENTION_KERNEL)

    def backward(pullback, ct):
        return (*pullback(ct), None)

    run.defvjp(forward, backward)
    return run


IMPLEMENTATIONS = {"xla": xla_attention, "cudnn": cudnn_attention, "pallas": pallas_attention,
                   "mosaic": mosaic_attention}


def attention(q, k, v, segment_ids=None, *, implementation: str = "xla", scale: Optional[float] = None,
              deterministic: bool = False, positions: Optional[jax.Array] = None, matmuls: Matmuls = Matmuls()):
    """deterministic: gradients bitwise reproducible run to run; 'xla' and 'pallas' always are, 'mosaic' switches
    to its dq kernel, 'cudnn' cannot promise it (ValueError)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention_impl: unknown implementation {implementation!r}; "
                         f"choose from {tuple(IMPLEMENTATIONS)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if deterministic and implementation == "cudnn":
        raise ValueError("model.deterministic_attention: cuDNN's attention backward is not deterministic here; "
                         "use model.attention_impl=pallas or mosaic")
    if implementation == "xla":
        return xla_attention(q, k, v, segment_ids, scale, positions, matmuls=matmuls)
    if implementation == "mosaic":
        kernel = lambda q, k, v, seg: mosaic_attention(q, k, v, seg, scale, deterministic=deterministic)  # noqa: E731
    else:
        kernel = lambda q, k, v, seg: IMPLEMENTATIONS[implementation](q, k, v, seg, scale)  # noqa: E731
    return residuals_named(kernel)(q, k, v, segment_ids)
