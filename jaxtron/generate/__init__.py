"""Batched text generation with a KV cache: greedy or nucleus (top-p) sampling, stopping at EOS.

    from jaxtron.generate import generate
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32, temperature=0.8, top_p=0.95, eos_id=0)
    out.tokens    # [batch, max_new_tokens] int32; after a row's EOS (included) the row holds pad_id
    out.lengths   # [batch] tokens generated per row, EOS included
    out.rows()    # list of lists, each row cut at its length

Prompts have different lengths and are **left-padded** to the longest one: every row then writes the same
cache slot at every step, so one fixed-shape program serves the whole batch. Padding slots are masked out of
attention and RoPE positions count from each row's first real token, so a padded row computes exactly what
it would compute alone.

The whole generation -- prefill of all prompts in one forward, then one token per iteration of a
``lax.while_loop`` against a fixed-size cache ``[layers, batch, prompt_len + max_new_tokens, kv_heads,
head_dim]`` (see :mod:`jaxtron.model.cache`) -- is one jitted program: nothing recompiles per token (it
compiles once per model, batch size, padded prompt length, ``max_new_tokens`` and greedy/sampling).
The loop ends early once every row has produced EOS.

``temperature == 0`` is greedy (argmax); otherwise logits are divided by the temperature, restricted to the
nucleus (the smallest set of most probable tokens whose probability reaches ``top_p``; ``top_p=1`` keeps
all) and sampled. Step ``i`` draws with ``fold_in(PRNGKey(seed), i)``, so a seed reproduces a generation,
with or without the cache. :func:`generate_no_cache` (``use_cache=False``) runs the training forward
(``Llama.__call__``) over the whole fixed-size buffer at every step instead: slow, for testing.
"""

from __future__ import annotations

from jaxtron.jax_startup import import_jax

import_jax()  # before this package imports JAX: quiet on a machine without a GPU

import contextlib
import functools
import json
import sys
import types
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.model.cache import init_cache

__all__ = ["generate", "generate_no_cache", "GenerateOutput", "nucleus_mask", "sample_logits", "decode_known"]


class GenerateOutput(NamedTuple):
    tokens: np.ndarray   # [batch, max_new_tokens] int32, pad_id after a row stopped
    lengths: np.ndarray  # [batch] int32: generated tokens per row (EOS included)

    def rows(self) -> list[list[int]]:
        return [[int(t) for t in row[:n]] for row, n in zip(self.tokens, self.lengths)]


# ============================================================================================ sampling


def nucleus_mask(logits: jax.Array, top_p) -> jax.Array:
    """Bool mask [..., vocab] of the nucleus: the most probable tokens, in order, up to and including the
    first one at which the cumulative probability reaches ``top_p`` (the most probable token is always in)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # probability mass ranked above each token
    keep_sorted = before < top_p
    keep_sorted = keep_sorted.at[..., 0].set(True)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)


def sample_logits(logits: jax.Array, key: jax.Array, temperature, top_p) -> jax.Array:
    """Token ids [...] drawn from ``logits [..., vocab]`` at ``temperature`` (> 0) within the top-p nucleus."""
    scaled = logits.astype(jnp.float32) / temperature
    masked = jnp.where(nucleus_mask(scaled, top_p), scaled, -jnp.inf)
    return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)


# ============================================================================================ generation


def _no_cache_logits(model, seq, start, index):
    """Logits [batch, vocab] at slot ``index`` from the training forward over the whole buffer ``seq``."""
    slots = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
    positions = jnp.maximum(slots - start[:, None], 0)
    segment_ids = (slots >= start[:, None]).astype(jnp.int32)  # left padding: its own segment, never seen
    logits = model(seq, positions, segment_ids)
    return jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False)


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "greedy", "use_cache"))
def _generate_core(model, tokens, start, key, temperature, top_p, eos_id, pad_id, *,
                   max_new_tokens: int, greedy: bool, use_cache: bool):
    batch, plen = tokens.shape
    n = max_new_tokens
    total = plen + n
    prompt_pos = jnp.maximum(jnp.arange(plen, dtype=jnp.int32)[None] - start[:, None], 0)

    if use_cache:
        cache = init_cache(model.cfg, batch, total)
        logits, buf = model.forward_cached(tokens, prompt_pos, cache, 0, start)
        last = logits[:, -1]
    else:
        buf = jnp.full((batch, total), pad_id, jnp.int32).at[:, :plen].set(tokens)
        last = _no_cache_logits(model, buf, start, plen - 1)

    def pick(logits, i):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return sample_logits(logits, jax.random.fold_in(key, i), temperature, top_p)

    def cond(carry):
        i, _, _, done, _, _ = carry
        return (i < n) & ~jnp.all(done)

    def body(carry):
        i, last, out, done, lengths, buf = carry
        tok = jnp.where(done, pad_id, pick(last, i))
        out = out.at[:, i].set(tok)
        lengths = jnp.where(done, lengths, i + 1)
        done = done | (tok == eos_id)
        pos = (plen - start) + i  # RoPE position of the new token
        if use_cache:
            logits, buf = model.forward_cached(tok[:, None], pos[:, None], buf, plen + i, start)
            last = logits[:, 0]
        else:
            buf = jax.lax.dynamic_update_slice(buf, tok[:, None], (0, plen + i))
            last = _no_cache_logits(model, buf, start, plen + i)
        return i + 1, last, out, done, lengths, buf

    carry = (jnp.int32(0), last, jnp.full((batch, n), pad_id, jnp.int32), jnp.zeros((batch,), jnp.bool_),
             jnp.zeros((batch,), jnp.int32), buf)
    _, _, out, _, lengths, _ = jax.lax.while_loop(cond, body, carry)
    return out, lengths


def _left_pad(prompt_tokens, vocab_size: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompt_tokens, np.ndarray) or hasattr(prompt_tokens, "shape"):
        arr = np.asarray(prompt_tokens)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ValueError(f"generate: prompt_tokens must be [batch, len] or a list of token lists, "
                             f"got shape {arr.shape}")
        rows = list(arr)
    else:
        rows = [np.asarray(list(r), dtype=np.int64) for r in prompt_tokens]
    if not rows:
        raise ValueError("generate: no prompts")
    for i, r in enumerate(rows):
        if r.ndim != 1 or len(r) == 0:
            raise ValueError(f"generate: prompt {i} is empty (every prompt needs at least one token)")
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab_size}) "
                             f"(min {int(r.min())}, max {int(r.max())})")
    plen = max(len(r) for r in rows)
    tokens = np.full((len(rows), plen), pad_id, np.int32)
    start = np.zeros(len(rows), np.int32)
    for i, r in enumerate(rows):
        tokens[i, plen - len(r):] = r
        start[i] = plen - len(r)
    return tokens, start


def generate(model, prompt_tokens, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             eos_id: Optional[int] = None, seed: int = 0, pad_id: Optional[int] = None,
             use_cache: bool = True, layout=None) -> GenerateOutput:
    """Continue each prompt (a list of token-id lists of any lengths, or a ``[batch, len]`` array) by up to
    ``max_new_tokens`` tokens. See the module docstring; ``pad_id`` defaults to ``eos_id`` (or 0).

    ``layout`` (a :class:`jaxtron.parallel.layout.Layout`, e.g. ``jaxtron.preflight.inference_layout(cfg.model,
    ["parallel.tensor=2"])``, with the model placed on it by ``layout.place(model)``): generation runs on its
    mesh under its rules, the same sharding constraints as training (heads, MLP, vocab and the KV cache split
    over tensor parallelism)."""
    vocab = model.cfg.vocab_size
    if int(max_new_tokens) < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"generate: eos_id {eos_id} is outside the vocabulary [0, {vocab})")
    pad = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    if not 0 <= pad < vocab:
        raise ValueError(f"generate: pad_id {pad} is outside the vocabulary [0, {vocab})")
    tokens, start = _left_pad(prompt_tokens, vocab, pad)
    with (layout.tracing() if layout is not None else contextlib.nullcontext()):
        out, lengths = _generate_core(
            model, jnp.asarray(tokens), jnp.asarray(start), jax.random.PRNGKey(seed),
            jnp.float32(temperature if temperature > 0 else 1.0), jnp.float32(top_p),
            jnp.int32(-1 if eos_id is None else eos_id), jnp.int32(pad),
            max_new_tokens=int(max_new_tokens), greedy=temperature == 0, use_cache=use_cache)
    return GenerateOutput(np.asarray(out), np.asarray(lengths))


def generate_no_cache(model, prompt_tokens, **kwargs) -> GenerateOutput:
    """:func:`generate` recomputing the full training forward at every step (no KV cache); for testing."""
    return generate(model, prompt_tokens, use_cache=False, **kwargs)


def decode_known(tok, ids) -> tuple[str, int]:
    """``(text, unknown)``: ``ids`` decoded, each id the tokenizer does not have (a model whose vocabulary is
    larger than the tokenizer's, e.g. ``--tokenizer byte`` on a BPE model) shown as U+FFFD and counted."""
    size = getattr(tok, "vocab_size", None)
    if size is None or all(0 <= i < size for i in ids):
        return tok.decode(ids), 0
    parts, run, unknown = [], [], 0
    for i in ids:
        if 0 <= i < size:
            run.append(i)
            continue
        parts.append(tok.decode(run) if run else "")
        parts.append("\ufffd")
        run, unknown = [], unknown + 1
    parts.append(tok.decode(run) if run else "")
    return "".join(parts), unknown


def to_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


class _CallableModule(types.ModuleType):
    """``jaxtron.generate(...)`` calls :func:`generate` (the package ``jaxtron`` re-exports this module)."""

    def __call__(self, *args, **kwargs) -> GenerateOutput:
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
