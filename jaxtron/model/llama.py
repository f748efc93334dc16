"""Llama 2/3, Qwen2 and Qwen3 (dense): embed -> scan(decoder block) -> norm -> LM head.

    model = Llama(cfg.model, rngs=nnx.Rngs(0))
    logits = model(tokens)                       # [batch, seq, vocab], fp32
    logits = model(tokens, positions, segment_ids)  # packed documents

The decoder blocks are created stacked (a leading ``layers`` axis on every block weight) and run with
``jax.lax.scan``, so compile time does not grow with depth; the remat policy wraps the scanned block.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, compute_dtype
from jaxtron.model.cache import KVCache, LayerCache, cache_mask
from jaxtron.model.layers import Attention, RMSNorm, Rope, SwiGLU, param, rope_frequencies, rope_tables
from jaxtron.model.projection import project
from jaxtron.parallel.sharding import constrain

RESIDUAL = ("act_batch", "act_res_seq", "act_embed")

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x, rope: Rope, segment_ids, cache: Optional[LayerCache] = None):
        if cache is not None:  # decoding: the same block, its attention reading and writing the KV cache
            a, kv = self.attention(self.attn_norm(x), rope, segment_ids, cache)
            x = constrain(x + a, RESIDUAL)
            return constrain(x + self.mlp(self.mlp_norm(x)), RESIDUAL), kv
        x = x + self.attention(self.attn_norm(x), rope, segment_ids)
        x = constrain(x, RESIDUAL)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, RESIDUAL)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderBlock:
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers,
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> DecoderBlock:
        return DecoderBlock(cfg, rngs=rngs)

    return create(rngs)


class Llama(nnx.Module):
    """A Llama-family decoder (Llama 2/3, Qwen2, Qwen3) as a Flax NNX module: embed -> scanned decoder blocks ->
    RMSNorm -> LM head. ``Llama(cfg.model, rngs=nnx.Rngs(seed))`` builds it on the default device;
    ``jaxtron.create_model(cfg, mesh)`` builds it with its parameters sharded on a mesh.

    ``model(tokens, positions=None, segment_ids=None)``: ``tokens`` int ``[batch, seq]`` -> fp32 logits
    ``[batch, seq, vocab]``. ``positions`` (RoPE; default 0..seq-1) and ``segment_ids`` (packed documents
    attend only within their segment) are int ``[batch, seq]``. Parameters carry logical axis names only."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        # Sharding is applied by jaxtron.parallel from the logical names, never eagerly here.
        with nnx.use_eager_sharding(False):
            self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                               cfg.initializer_range, pd)
            self.layers = _stacked_blocks(cfg, rngs)
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
            if not cfg.tie_embeddings:
                self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                     cfg.initializer_range, pd)

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed_tokens(tokens)
        x = self.run_layers(x, positions, segment_ids)
        return self.logits(x)

    # The three parts of the forward, usable on their own (a pipeline runs ``run_layers`` on a slice of the
    # stacked layers, the embedding before it and the logits after it).

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """[batch, seq] token ids -> [batch, seq, hidden] in the compute dtype."""
        dt = jnp.dtype(compute_dtype(self.cfg))
        # Vocab-parallel lookup: the table (gathered over its FSDP shards, vocab still split) is indexed
        # by the tokens and the partial rows summed across the vocab split.
        table = constrain(self.embed[...].astype(dt), ("vocab", "act_embed"))
        return constrain(jnp.take(table, tokens, axis=0), RESIDUAL)

    def _rope(self, positions: jax.Array) -> Rope:
        inv_freq = rope_frequencies(self.cfg)
        if self.cfg.rope_impl == "xla":  # the cos/sin tables once for all the layers
            return Rope(positions, inv_freq, *rope_tables(positions, inv_freq))
        return Rope(positions, inv_freq)

    def run_layers(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
        """The stacked decoder blocks (however many ``self.layers`` holds), scanned (``scan_unroll`` blocks per
        iteration), with the remat policy."""
        rope = self._rope(positions)
        graphdef, state = nnx.split(self.layers)

        def block(carry, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return layer(carry, rope, segment_ids), None

        if self.cfg.remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        x, _ = jax.lax.scan(block, x, state, unroll=self.cfg.scan_unroll)
        return x

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, index, start: jax.Array
                       ) -> tuple[jax.Array, KVCache]:
        """Decoding: logits ``[batch, s, vocab]`` (fp32) of ``tokens [batch, s]`` written at cache slots
        ``index..index+s-1`` (RoPE ``positions [batch, s]``), and the updated cache; ``start [batch]`` is each
        row's first real slot (left padding before it is never attended to). The training blocks run as in
        :meth:`run_layers`, their attention against the cache (:mod:`jaxtron.model.cache`)."""
        index = jnp.asarray(index, jnp.int32)
        x = self.embed_tokens(tokens)
        rope = self._rope(positions)
        mask = cache_mask(start.astype(jnp.int32), index, tokens.shape[1], cache.k.shape[2])
        graphdef, state = nnx.split(self.layers)

        def block(x, xs):
            layer_state, k, v = xs
            x, kv = nnx.merge(graphdef, layer_state)(x, rope, None, LayerCache(k, v, index, mask))
            return x, kv

        x, (k, v) = jax.lax.scan(block, x, (state, cache.k, cache.v))
        return self.logits(x), KVCache(k, v)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: [batch, seq, hidden] -> fp32 logits [batch, seq, vocab]."""
        x = self.final_norm(x)
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        logits = project("bsd,dv->bsv", x, head.astype(x.dtype), jnp.float32)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))
