"""Context parallelism: the sequence axis of activations split over the ``context`` mesh axis.

The rules table maps the activations' sequence axis (``act_seq``, and ``act_res_seq``) onto ``context``;
parameters are not split over it, so XLA reduces their gradients over it as over data parallelism.

``parallel.context_impl`` (the attention rules of :mod:`jaxtron.parallel.rules`):

* ``all_gather`` (Llama 3's long-context recipe): each rank keeps its queries and attends to K and V gathered
  over ``context`` (``act_kv_seq`` is unsplit, so the gather is an all-gather of the kv heads only, and its
  transpose in the backward a reduce-scatter of dK and dV);
* ``ring``: K and V stay split and are passed round the ring (:mod:`jaxtron.parallel.ring_attention`); no rank
  ever holds the whole sequence's K and V;
* ``ulysses`` (DeepSpeed-Ulysses): all-to-alls trade the sequence split for a head split before attention and
  back after; heads and kv heads must be divisible by context x tensor.

Causal load balance: with a plain split, rank 0's queries see one chunk of keys and the last rank's see all
of them. :func:`balance` reorders every sequence of the batch once, before the embedding, into 2*CP chunks so
that rank r holds chunks r and 2*CP-1-r (every rank then does the same causal work). Positions and segment ids
travel with the tokens, RoPE reads the positions, and the attention mask is built from positions and segment
ids rather than from the index, so the result is exact; the loss is a sum over tokens, so the order does not
change it.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from jaxtron.config.schema import Config, ConfigError

IMPLEMENTATIONS = ("all_gather", "ring", "ulysses")


def check_context(cfg: Config, context: Optional[int], tensor: Optional[int]) -> None:
    """The config errors of ``parallel.context`` (``context``/``tensor``: the resolved sizes, None if unknown)."""
    p, m = cfg.parallel, cfg.model
    if p.context_impl not in IMPLEMENTATIONS:
        raise ConfigError("parallel.context_impl", f"{p.context_impl!r} is not an implementation; choose from "
                                                   f"{IMPLEMENTATIONS}")
    if context is None or context == 1:
        return
    if context < 1:
        raise ConfigError("parallel.context", f"must be >= 1 (or -1), got {context}")
    seq = cfg.data.seq_len
    if seq % (2 * context):
        raise ConfigError("data.seq_len", f"{seq} is not divisible by 2 x parallel.context = {2 * context} (each "
                                          "context rank holds two chunks of every sequence: causal load balance)")
    if p.sequence_parallel and tensor and seq % (context * tensor):
        raise ConfigError("data.seq_len", f"{seq} is not divisible by parallel.context x parallel.tensor = "
                                          f"{context * tensor} (sequence_parallel)")
    if p.context_impl == "ring" and p.stage > 1:
        # the ring's ppermute inside the pipeline's stage-manual shard_map gives NaN (gpipe) or deadlocks
        # (1f1b: the stages reach different collective-permutes) on XLA:CPU; not supported until it is tested
        raise ConfigError("parallel.context_impl", "ring does not run inside the pipeline (parallel.stage > 1) "
                                                   "yet; use all_gather or ulysses")
    if p.context_impl == "ulysses":
        split = context * (tensor or 1)
        if m.num_heads % split:  # kv heads need not divide: they are repeated for their query groups
            raise ConfigError("parallel.context_impl", f"ulysses splits heads over context x tensor = {split}, "
                                                       f"which does not divide model.num_heads={m.num_heads}; "
                                                       "use ring or all_gather")
    if m.attention_impl not in ("xla", "pallas"):
        raise ConfigError("model.attention_impl", f"{m.attention_impl!r} does not run with parallel.context > 1 "
                                                  "(it returns no log-sum-exp to merge the pieces of a split "
                                                  "sequence by, nor masks by piece): use pallas or xla")


def balance_order(seq_len: int, context: int) -> np.ndarray:
    """The permutation of sequence positions that gives rank r chunks r and 2*CP-1-r (of 2*CP equal chunks)."""
    chunks = np.arange(seq_len).reshape(2 * context, seq_len // (2 * context))
    order = [i for r in range(context) for i in (r, 2 * context - 1 - r)]
    return chunks[order].reshape(-1)


def balance(batch: dict, context: int) -> dict:
    """Every [batch, seq] array of ``batch`` in the load-balanced order (unchanged with context 1)."""
    if context == 1:
        return batch
    seq_len = batch["inputs"].shape[1]
    order = jnp.asarray(balance_order(seq_len, context))
    return {k: jnp.take(v, order, axis=1) if v.ndim >= 2 and v.shape[1] == seq_len else v
            for k, v in batch.items()}


def imbalance(segment_ids: np.ndarray, context: int, balanced: bool = True) -> float:
    """Causal attention work per context rank, max over mean: the (query, key) pairs each rank's queries
    attend to (same document, key not after query), summed over the batch ([batch, seq] segment ids)."""
    b, s = segment_ids.shape
    order = balance_order(s, context) if balanced else np.arange(s)
    pos = np.arange(s)
    work = np.zeros(context)
    for row in segment_ids:
        allowed = (row[:, None] == row[None, :]) & (pos[:, None] >= pos[None, :])
        per_query = allowed.sum(1)[order]
        work += per_query.reshape(context, -1).sum(1)
    return float(work.max() / work.mean())
