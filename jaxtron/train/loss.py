"""Next-token cross entropy in fp32 with a loss mask, plus the optional z-loss; whole, or a chunk of tokens at a
time through the LM head (``model.loss_chunk_tokens``)."""

from __future__ import annotations

import functools
from typing import Callable

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


def loss_chunks(rows: int, seq: int, chunk_tokens: int) -> tuple[int, int]:
    """(chunks, positions per chunk) splitting a [rows, seq] micro batch into chunks of at most about
    ``chunk_tokens`` tokens (rows x positions; one position of every row at least). The last chunks take the
    padding when the positions do not divide evenly."""
    chunks = min(seq, max(1, -(-rows * seq // chunk_tokens)))
    per_chunk = -(-seq // chunks)
    return -(-seq // per_chunk), per_chunk  # rounding up the width may leave fewer chunks


def chunked_cross_entropy_sums(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                               loss_mask: jax.Array, z_loss: float, chunk_tokens: int):
    """:func:`cross_entropy_sums` of ``head(hidden)`` (the LM head: [rows, positions, hidden] -> fp32 logits)
    computed a chunk of about ``chunk_tokens`` tokens at a time (:func:`loss_chunks`), so that neither the
    forward nor the backward holds the logits of more than one chunk: a scan over the chunks whose body is
    checkpointed, so the backward recomputes each chunk's logits from its hidden states. The same sums as the
    whole micro batch's, up to fp32 reassociation.

    Chunk j holds positions j, j + chunks, j + 2 * chunks, ... of every row: the rows and the sequence keep
    the batch's sharding (a sequence split over devices in contiguous blocks stays split), and the loss is a
    sum over tokens, so their order does not matter. Padding positions have a zero mask and zero hidden
    states: they add exact zeros to the sums and the gradients."""
    rows, seq = targets.shape
    chunks, per_chunk = loss_chunks(rows, seq, chunk_tokens)
    pad = chunks * per_chunk - seq
    if pad:
        widen = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        hidden, targets, loss_mask = widen(hidden), widen(targets), widen(loss_mask)
    # [rows, per_chunk * chunks, ...] -> [chunks, rows, per_chunk, ...], chunk j = positions j mod chunks
    split = lambda a: jnp.moveaxis(a.reshape(rows, per_chunk, chunks, *a.shape[2:]), 2, 0)

    @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan CSE cannot merge the recomputation
    def chunk_sums(x, t, m):
        return cross_entropy_sums(head(x), t, m, z_loss)

    def body(acc, chunk):
        return tuple(a + b for a, b in zip(acc, chunk_sums(*chunk))), None

    zero = jnp.zeros((), jnp.float32)
    sums, _ = jax.lax.scan(body, (zero, zero, zero), (split(hidden), split(targets), split(loss_mask)))
    return sums
