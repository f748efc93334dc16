"""Next-token cross entropy in fp32 with a loss mask, plus the optional z-loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array, z_loss: float = 0.0):
    """Sums over unmasked tokens: (cross entropy, z-loss term, token count). Divide by the count outside,
    so that gradient accumulation over micro batches equals one big batch exactly."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot select rather than a gather: elementwise, so vocab-sharded logits need no gather partitioning
    # (XLA's gather partitioner fails inside a pipeline's partly manual region); the sum adds exact zeros.
    vocab = jnp.arange(logits.shape[-1], dtype=targets.dtype)
    target_logit = jnp.sum(jnp.where(targets[..., None] == vocab, logits, 0.0), axis=-1)
    mask = loss_mask.astype(jnp.float32)
    ce = jnp.sum((lse - target_logit) * mask)
    z = jnp.sum(z_loss * jnp.square(lse) * mask) if z_loss else jnp.zeros((), jnp.float32)
    return ce, z, jnp.sum(mask)
