"""Held-out loss and perplexity of a model over non-overlapping windows of a token stream.

    from jaxtron.evaluate import evaluate, windows_from_tokens
    result = evaluate(model, windows_from_tokens(tokens, seq_len=512, batch_size=8))
    result["loss"], result["perplexity"]          # perplexity == exp(loss)

A *window* is ``seq_len + 1`` consecutive tokens: the model reads the first ``seq_len`` and is scored on
predicting the last ``seq_len``. Window ``j`` starts at token ``j * seq_len``, so consecutive windows share
one boundary token and every token of the stream except the first is predicted exactly once (no token is
seen as context twice: the windows do not overlap). A trailing remainder shorter than a full window is
dropped. The loss is the mean next-token cross entropy (fp32, ``jaxtron.train.loss.cross_entropy_sums``)
over all scored tokens; perplexity is its exponential.

Streams: a Megatron ``.bin/.idx`` prefix (its sequences concatenated in order, as stored -- end-of-document
tokens are whatever the dataset holds) or a plain text file tokenized whole (byte-level by default).
"""

from __future__ import annotations

from jaxtron.jax_startup import import_jax

import_jax()  # before this package imports JAX: quiet on a machine without a GPU

import contextlib
import math
import os
import sys
import types
from typing import Callable, Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.data.indexed import IndexedDataset, bin_path, idx_path
from jaxtron.parallel.stages import BATCH_AXES
from jaxtron.train.loss import cross_entropy_sums

__all__ = ["evaluate", "windows_from_tokens", "token_stream", "indexed_tokens", "text_tokens", "num_batches"]


@nnx.jit
def _loss_sums(model, inputs, targets, mask):
    logits = model(inputs)
    ce, _, count = cross_entropy_sums(logits, targets, mask)
    return ce, count


def _as_batch(batch):
    if isinstance(batch, dict):
        inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
        mask = np.asarray(batch.get("loss_mask", np.ones(inputs.shape, np.float32)), np.float32)
        return inputs, targets, mask
    w = np.asarray(batch)
    if w.ndim != 2 or w.shape[1] < 2:
        raise ValueError(f"evaluate: a batch must be windows [batch, seq_len + 1], got shape {w.shape}")
    return w[:, :-1], w[:, 1:], np.ones((w.shape[0], w.shape[1] - 1), np.float32)


def evaluate(model, batches: Iterable, progress: Optional[Callable[[int, int, float], None]] = None,
             layout=None) -> dict:
    """Mean token loss and perplexity of ``model`` over ``batches``: each batch is an array of windows
    ``[batch, seq_len + 1]`` (all tokens scored) or a dict with ``inputs``, ``targets`` ``[batch, seq_len]``
    and optionally ``loss_mask``. A batch smaller than the first is padded (masked out) to its size, so one
    compiled program serves all. ``progress(batches_done, tokens_scored, mean_loss_so_far)`` is called after
    each batch. ``layout`` (a :class:`jaxtron.parallel.layout.Layout`, the model placed on it by
    ``layout.place``, e.g. ``jaxtron.preflight.inference_layout(cfg, ["parallel.data=-1"])``): the batches are
    split over its data-parallel devices (padded, masked, to a multiple of them). Returns ``{"loss",
    "perplexity", "tokens", "batches"}``."""
    vocab = model.cfg.vocab_size
    dp = layout.dp if layout is not None else 1
    put = jnp.asarray if layout is None else (lambda x: jax.device_put(x, layout.sharding(BATCH_AXES)))
    total, count, n, shape = 0.0, 0.0, 0, None
    for batch in batches:
        inputs, targets, mask = _as_batch(batch)
        if inputs.size and (min(inputs.min(), targets.min()) < 0 or max(inputs.max(), targets.max()) >= vocab):
            raise ValueError(f"evaluate: token ids outside the model's vocabulary [0, {vocab})")
        if shape is None:
            shape = (-(-inputs.shape[0] // dp) * dp, inputs.shape[1])
        if inputs.shape != shape:
            if inputs.shape[1] != shape[1] or inputs.shape[0] > shape[0]:
                raise ValueError(f"evaluate: batch of shape {inputs.shape} after batches of {shape}")
            pad = shape[0] - inputs.shape[0]
            inputs = np.concatenate([inputs, np.zeros((pad, shape[1]), inputs.dtype)])
            targets = np.concatenate([targets, np.zeros((pad, shape[1]), targets.dtype)])
            mask = np.concatenate([mask, np.zeros((pad, shape[1]), np.float32)])
        with layout.tracing() if layout is not None else contextlib.nullcontext():
            ce, c = _loss_sums(model, put(inputs.astype(np.int32)), put(targets.astype(np.int32)),
                               put(mask.astype(np.float32)))
        total += float(ce)
        count += float(c)
        n += 1
        if progress is not None:
            progress(n, int(count), total / max(count, 1.0))
    if count == 0:
        raise ValueError("evaluate: no tokens to score (the data is shorter than one window of seq_len + 1 "
                         "tokens?)")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count), "batches": n}


def token_stream(chunks: Iterable[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens of the concatenated ``chunks``."""
    buf = np.zeros(0, np.int64)
    for chunk in chunks:
        buf = np.concatenate([buf, np.asarray(chunk, np.int64)])
        while len(buf) >= seq_len + 1:
            yield buf[:seq_len + 1]
            buf = buf[seq_len:]


def windows_from_tokens(tokens, seq_len: int, batch_size: int, max_batches: Optional[int] = None,
                        ) -> Iterator[np.ndarray]:
    """Batches ``[<= batch_size, seq_len + 1]`` of the windows of ``tokens`` (one array or an iterable of
    chunks); at most ``max_batches`` batches."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"evaluate: seq_len and batch_size must be >= 1 (got {seq_len}, {batch_size})")
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    batch: list[np.ndarray] = []
    done = 0
    for w in token_stream(chunks, seq_len):
        if max_batches is not None and done >= max_batches:
            return
        batch.append(w)
        if len(batch) == batch_size:
            yield np.stack(batch)
            batch, done = [], done + 1
    if batch and (max_batches is None or done < max_batches):
        yield np.stack(batch)


def indexed_tokens(prefix: str) -> Iterator[np.ndarray]:
    """The sequences of a Megatron ``.bin/.idx`` prefix, in order (lazily, from the memory map)."""
    ds = IndexedDataset(prefix)
    for i in range(len(ds)):
        yield ds.get(i)


def num_batches(num_tokens: int, seq_len: int, batch_size: int, max_batches: Optional[int] = None) -> int:
    """How many batches :func:`windows_from_tokens` yields for a stream of ``num_tokens`` tokens."""
    windows = max(num_tokens - 1, 0) // seq_len
    n = -(-windows // batch_size)
    return n if max_batches is None else min(n, max_batches)


def text_tokens(path: str, tokenizer) -> np.ndarray:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return np.asarray(tokenizer.encode(text), np.int64)


def data_kind(data: str) -> tuple[str, str]:
    """('indexed', prefix) for a ``.bin/.idx`` prefix (given with or without the suffix), ('text', path) for
    any other existing file; ValueError otherwise."""
    prefix = data[:-4] if data.endswith((".bin", ".idx")) else data
    if os.path.isfile(idx_path(prefix)) or os.path.isfile(bin_path(prefix)):
        for p in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(p):
                raise ValueError(f"--data: {os.path.abspath(p)} is missing (a Megatron prefix needs .bin and .idx)")
        return "indexed", prefix
    if os.path.isfile(data):
        return "text", data
    raise ValueError(f"--data: {os.path.abspath(data)} is neither a text file nor a .bin/.idx prefix")


class _CallableModule(types.ModuleType):
    """``jaxtron.evaluate(...)`` calls :func:`evaluate` (the package ``jaxtron`` re-exports this module)."""

    def __call__(self, *args, **kwargs) -> dict:
        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
