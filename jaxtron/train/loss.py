"""Next-token cross entropy in fp32 with a loss mask, plus the optional z-loss; whole, or a chunk of tokens at a
time through the LM head (``model.loss_chunk_tokens``); the shifted targets of multi-token prediction."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


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


def mtp_key(name: str, depth: int) -> str:
    """The batch key of an MTP depth's shifted array (:func:`with_mtp_targets`): ``mtp_inputs_1`` ..."""
    return f"mtp_{name}_{depth}"


def with_mtp_targets(batch: dict, depth: int, same_document: bool) -> dict:
    """``batch`` plus, for each multi-token-prediction depth k = 1..``depth`` (docs/mtp.md), three [batch, seq]
    arrays whose position t holds: ``mtp_inputs_k`` the token t+k (what depth k embeds), ``mtp_targets_k`` the
    token t+k+1 (``targets`` shifted k further) and ``mtp_mask_k`` its loss mask, 0 past the end of the row and,
    with ``same_document`` (packed documents that attend only within themselves), where t+k lies in another
    document than t. Made from the whole sequences, before any reordering (context parallelism's load balance
    permutes positions, so a shift afterwards would read the wrong neighbours)."""
    out = dict(batch)
    shift = lambda x, k: jnp.pad(x[:, k:], [(0, 0), (0, min(k, x.shape[1]))] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    for k in range(1, depth + 1):
        mask = shift(batch["loss_mask"], k)
        if same_document:
            mask = jnp.where(shift(batch["segment_ids"], k) == batch["segment_ids"], mask, 0)
        out[mtp_key("inputs", k)] = shift(batch["inputs"], k)
        out[mtp_key("targets", k)] = shift(batch["targets"], k)
        out[mtp_key("mask", k)] = mask
    return out


def loss_chunks(rows: int, seq: int, chunk_tokens: int) -> tuple[int, int]:
    """(chunks, positions per chunk) splitting a [rows, seq] micro batch into chunks of about ``chunk_tokens``
    tokens (rows x positions per chunk; one position of every row at least). The last chunks take the padding
    when the positions do not divide evenly."""
    chunks = min(seq, max(1, -(-rows * seq // chunk_tokens)))
    per_chunk = -(-seq // chunks)
    return -(-seq // per_chunk), per_chunk  # rounding up the width may leave fewer chunks


def chunked_cross_entropy_sums(head: Callable[[jax.Array, jax.Array], jax.Array], weight: jax.Array,
                               hidden: jax.Array, targets: jax.Array, loss_mask: jax.Array, z_loss: float,
                               chunk_tokens: int):
    """:func:`cross_entropy_sums` of ``head(hidden, weight)`` (the LM head: [rows, positions, hidden] and its
    weight -> fp32 logits) computed a chunk of about ``chunk_tokens`` tokens at a time (:func:`loss_chunks`),
    so that neither the forward nor the backward holds the logits of more than one chunk: a scan over the
    chunks, and in the backward a second scan that recomputes each chunk's logits from its hidden states. The
    same sums and gradients as the whole micro batch's, up to fp32 reassociation.

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
    return _chunk_loop(head, z_loss, split(hidden), weight, split(targets), split(loss_mask).astype(jnp.float32))


def _chunk_sums(head, z_loss, x, weight, targets, mask):
    return cross_entropy_sums(head(x, weight), targets, mask, z_loss)


# A custom_vjp rather than jax.checkpoint around the scan body: differentiating a scan accumulates the gradient
# of a weight it closes over in that weight's dtype, chunk after chunk, so either a bf16 head sums its chunks'
# gradients in bf16, or an fp32 head stays alive through the loops and is cast again for every chunk. Here the
# forward casts the head to the compute dtype once (that copy is what the backward keeps) and the backward adds
# the chunks' gradients into an fp32 accumulator, returned in the head's own dtype.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunk_loop(head, z_loss, xs, weight, targets, mask):
    return _chunk_loop_fwd(head, z_loss, xs, weight, targets, mask)[0]


def _chunk_loop_fwd(head, z_loss, xs, weight, targets, mask):
    w = weight.astype(xs.dtype)

    def body(acc, chunk):
        return tuple(a + b for a, b in zip(acc, _chunk_sums(head, z_loss, chunk[0], w, *chunk[1:]))), None

    zero = jnp.zeros((), jnp.float32)
    sums, _ = jax.lax.scan(body, (zero, zero, zero), (xs, targets, mask))
    return sums, (xs, w, targets, mask, jnp.zeros((0,), weight.dtype))


def _chunk_loop_bwd(head, z_loss, residuals, cotangent):
    xs, w, targets, mask, weight_dtype = residuals

    def body(dw, chunk):
        x, t, m = chunk
        _, vjp = jax.vjp(lambda x, w: _chunk_sums(head, z_loss, x, w, t, m), x, w)
        dx, dw_chunk = vjp(cotangent)
        return dw + dw_chunk.astype(jnp.float32), dx

    dw, dxs = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (xs, targets, mask))
    no_targets = np.zeros(targets.shape, jax.dtypes.float0)  # integers: no gradient
    return dxs, dw.astype(weight_dtype.dtype), no_targets, jnp.zeros_like(mask)


_chunk_loop.defvjp(_chunk_loop_fwd, _chunk_loop_bwd)
