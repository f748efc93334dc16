"""Llama 2/3, Qwen2 and Qwen3 (dense): embed -> scan(decoder block) -> norm -> LM head.

    model = Llama(cfg.model, rngs=nnx.Rngs(0))
    logits = model(tokens)                       # [batch, seq, vocab], fp32
    logits = model(tokens, positions, segment_ids)  # packed documents

The decoder blocks are created stacked (a leading ``layers`` axis on every block weight) and run with
``jax.lax.scan``, so compile time does not grow with depth; the remat policy wraps the scanned block.

Mixture-of-Experts models (``model.moe.num_experts > 0``) group their layers by kind, each group a stack of
its own, scanned one after the other (docs/moe.md):

- ``dense_layers``: the first ``model.moe.first_dense_layers`` blocks, dense SwiGLU (absent when 0);
- ``layers``: the rest, one scanned unit per ``model.moe.layer_freq`` layers. With layer_freq 1 the unit is a
  :class:`DecoderBlock` whose ``mlp`` is an :class:`~jaxtron.model.moe.MoE`; otherwise a :class:`MoEGroup` of
  layer_freq - 1 dense blocks (``dense_0``...) and then one MoE block (``moe``).

Dense models keep the single ``layers`` stack of dense blocks, so their parameter tree, checkpoints, pipeline
stages and Hugging Face mappings are unchanged.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, compute_dtype
from jaxtron.model import remat
from jaxtron.model.cache import KVCache, LayerCache, cache_mask
from jaxtron.model.layers import (Attention, RMSNorm, Rope, SwiGLU, param, rope_attention_factor, rope_frequencies,
                                  rope_tables)
from jaxtron.model.mla import LatentAttention
from jaxtron.model.moe import MoE
from jaxtron.model.mtp import MTPModule
from jaxtron.model.projection import Matmuls
from jaxtron.parallel import embedding
from jaxtron.parallel.sharding import constrain, matmul_weight

RESIDUAL = ("act_batch", "act_res_seq", "act_embed")


class DecoderBlock(nnx.Module):
    """Attention and a feed-forward block, pre-norm. With ``moe=True`` the feed-forward block is an
    :class:`~jaxtron.model.moe.MoE` and the (uncached) call returns ``(x, router stats)``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Matmuls, moe: bool = False):
        pd = jnp.dtype(cfg.param_dtype)
        self.is_moe = moe
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        attention = LatentAttention if cfg.mla.kv_lora_rank else Attention  # MLA: jaxtron/model/mla.py
        self.attention = attention(cfg, rngs=rngs, matmuls=matmuls)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.mlp = MoE(cfg, rngs=rngs, matmuls=matmuls) if moe else SwiGLU(cfg, rngs=rngs, matmuls=matmuls)

    def _ffn(self, x):
        out = self.mlp(remat.tag(self.mlp_norm(x), remat.MLP_IN))
        y, stats = out if self.is_moe else (out, None)
        return remat.tag(y, remat.MLP_OUT), stats

    def __call__(self, x, rope: Rope, segment_ids, cache: Optional[LayerCache] = None):
        if cache is not None:  # decoding: the same block, its attention reading and writing the KV cache
            a, kv = self.attention(self.attn_norm(x), rope, segment_ids, cache)
            x = constrain(x + a, RESIDUAL)
            return constrain(x + self._ffn(x)[0], RESIDUAL), kv
        x = x + self.attention(self.attn_norm(x), rope, segment_ids)
        x = constrain(x, RESIDUAL)
        y, stats = self._ffn(x)
        x = constrain(x + y, RESIDUAL)
        return (x, stats) if self.is_moe else x


class MoEGroup(nnx.Module):
    """One scanned unit of an MoE model with ``model.moe.layer_freq`` = F > 1: F - 1 dense blocks, then an MoE
    block (Qwen's decoder_sparse_step: layer j is MoE when (j+1) % F == 0). Unrolled inside the unit: F is
    small, and the unit itself is scanned."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Matmuls):
        self.num_dense = cfg.moe.layer_freq - 1
        for i in range(self.num_dense):
            setattr(self, f"dense_{i}", DecoderBlock(cfg, rngs=rngs, matmuls=matmuls))
        self.moe = DecoderBlock(cfg, rngs=rngs, matmuls=matmuls, moe=True)

    def __call__(self, x, rope: Rope, segment_ids, cache: Optional[LayerCache] = None):
        """Without ``cache``: (x, stats). With it (k and v [F, ...], one per block): (x, (k, v))."""
        blocks = [getattr(self, f"dense_{i}") for i in range(self.num_dense)] + [self.moe]
        if cache is None:
            for blk in blocks[:-1]:
                x = blk(x, rope, segment_ids)
            return self.moe(x, rope, segment_ids)
        ks, vs = [], []
        for i, blk in enumerate(blocks):
            x, (k, v) = blk(x, rope, segment_ids, LayerCache(cache.k[i], cache.v[i], cache.index, cache.mask))
            ks.append(k)
            vs.append(v)
        return x, (jnp.stack(ks), jnp.stack(vs))


def _stacked(count: int, make, rngs: nnx.Rngs, axis: str = "layers"):
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count, transform_metadata={nnx.PARTITION_NAME: axis})
    def create(rngs: nnx.Rngs):
        return make(rngs)

    return create(rngs)


def layer_stacks(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(params key, scanned units, decoder layers per unit) of each stack, in forward order."""
    e = cfg.moe
    if not e.num_experts:
        return [("layers", cfg.num_layers, 1)]
    stacks = [("dense_layers", e.first_dense_layers, 1)] if e.first_dense_layers else []
    return stacks + [("layers", (cfg.num_layers - e.first_dense_layers) // e.layer_freq, e.layer_freq)]


def _make_stack(cfg: ModelConfig, key: str, units: int, rngs: nnx.Rngs, matmuls: Matmuls):
    if key == "dense_layers":  # not split over pipeline stages: the first stage runs them before its chunk
        return _stacked(units, lambda r: DecoderBlock(cfg, rngs=r, matmuls=matmuls), rngs, axis="dense_layers")
    if not cfg.moe.num_experts:
        return _stacked(units, lambda r: DecoderBlock(cfg, rngs=r, matmuls=matmuls), rngs)
    if cfg.moe.layer_freq == 1:
        return _stacked(units, lambda r: DecoderBlock(cfg, rngs=r, matmuls=matmuls, moe=True), rngs)
    return _stacked(units, lambda r: MoEGroup(cfg, rngs=r, matmuls=matmuls), rngs)


class Llama(nnx.Module):
    """A Llama-family decoder (Llama 2/3, Qwen2, Qwen3) as a Flax NNX module: embed -> scanned decoder blocks ->
    RMSNorm -> LM head. ``Llama(cfg.model, rngs=nnx.Rngs(seed))`` builds it on the default device;
    ``jaxtron.create_model(cfg, mesh)`` builds it with its parameters sharded on a mesh.

    ``model(tokens, positions=None, segment_ids=None)``: ``tokens`` int ``[batch, seq]`` -> fp32 logits
    ``[batch, seq, vocab]``. ``positions`` (RoPE; default 0..seq-1) and ``segment_ids`` (packed documents
    attend only within their segment) are int ``[batch, seq]``. Parameters carry logical axis names only.

    ``matmuls`` (jaxtron/model/projection.py): how every matmul is computed, for the devices the model will run
    on; where a program is built it is the layout's (``Matmuls.on(layout.platform)``), else the default
    backend's. Not a parameter: it does not change the parameter tree."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, matmuls: Optional[Matmuls] = None):
        self.cfg = cfg
        self.matmuls = matmuls = matmuls or Matmuls.here()
        pd = jnp.dtype(cfg.param_dtype)
        # Sharding is applied by jaxtron.parallel from the logical names, never eagerly here.
        with nnx.use_eager_sharding(False):
            self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                               cfg.initializer_range, pd)
            for key, units, _ in layer_stacks(cfg):
                setattr(self, key, _make_stack(cfg, key, units, rngs, matmuls))
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
            if not cfg.tie_embeddings:
                self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                     cfg.initializer_range, pd)
            if cfg.mtp.num_layers:  # DeepSeek-V3 MTP (docs/mtp.md): one block of the last layer's kind per depth
                self.mtp = _stacked(cfg.mtp.num_layers, lambda r: MTPModule(
                    cfg, DecoderBlock(cfg, rngs=r, matmuls=matmuls, moe=bool(cfg.moe.num_experts)), rngs=r,
                    matmuls=matmuls), rngs, axis="mtp_layers")

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed_tokens(tokens)
        x = self.run_layers(x, positions, segment_ids)
        return self.logits(x)

    # The parts of the forward, usable on their own (a pipeline runs ``run_stack`` on a slice of the
    # stacked layers, the embedding before it and the logits after it).

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """[batch, seq] token ids -> [batch, seq, hidden] in the compute dtype."""
        dt = jnp.dtype(compute_dtype(self.cfg))
        # Vocab-parallel lookup: the table (gathered over its FSDP shards, vocab still split) is indexed
        # by each device's tokens and the partial rows summed across the vocab split.
        return constrain(embedding.lookup(self.embed[...], tokens, dt, ("vocab", "act_embed")), RESIDUAL)

    def rope(self, positions: jax.Array) -> Rope:
        """RoPE for these positions (the cos/sin tables computed once for all the layers with rope_impl=xla)."""
        inv_freq = rope_frequencies(self.cfg)
        if self.cfg.rope_impl == "xla":  # the cos/sin tables once for all the layers
            return Rope(positions, inv_freq, *rope_tables(positions, inv_freq, rope_attention_factor(self.cfg)))
        return Rope(positions, inv_freq)

    def forward_with_stats(self, tokens: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]):
        """(fp32 logits, MoE router stats): the stats are a dict of per-MoE-layer arrays (``aux_loss``,
        ``z_loss``, ``dropped``, ``assigned`` [L]; ``load`` [L, E]), or None for a dense model."""
        x, stats = self.hidden_with_stats(tokens, positions, segment_ids)
        return self.head(x), stats

    def hidden_with_stats(self, tokens: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]):
        """:meth:`forward_with_stats` without the LM head: the final-normed hidden states [batch, seq, hidden]
        (what :meth:`head` takes; a loss may apply it a chunk of tokens at a time) and the router stats."""
        x, stats = self.run_layers_with_stats(self.embed_tokens(tokens), positions, segment_ids)
        return self.final_norm(x), stats

    def run_layers(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
        """The stacked decoder blocks (however many ``self.layers`` holds), scanned (``scan_unroll`` blocks per
        iteration), with the remat policy."""
        return self.run_layers_with_stats(x, positions, segment_ids)[0]

    def run_layers_with_stats(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]):
        """:meth:`run_layers` and the MoE layers' router stats (None for a dense model)."""
        rope = self.rope(positions)
        stats = None
        for key, _, _ in layer_stacks(self.cfg):
            x, out = self.run_stack(key, x, rope, segment_ids)
            stats = out if out is not None else stats  # only the 'layers' stack of an MoE model has MoE layers
        return x, stats

    def run_stack(self, key: str, x: jax.Array, rope: Rope, segment_ids: Optional[jax.Array]):
        """One stack of decoder blocks (``layers`` or ``dense_layers``), scanned with the remat policy:
        (x, per-unit router stats or None)."""
        graphdef, state = nnx.split(getattr(self, key))

        def block(carry, layer_state):
            out = nnx.merge(graphdef, layer_state)(carry, rope, segment_ids)
            return out if isinstance(out, tuple) else (out, None)

        if self.cfg.remat != "none":
            block = jax.checkpoint(block, policy=remat.POLICIES[self.cfg.remat], prevent_cse=False)
        return jax.lax.scan(block, x, state, unroll=self.cfg.scan_unroll)

    def mtp_hidden(self, h: jax.Array, mtp_inputs: jax.Array, positions: jax.Array,
                   segment_ids: Optional[jax.Array]):
        """The MTP modules (``model.mtp``) on ``h``, the main model's last hidden state before the final norm
        (:meth:`run_layers_with_stats`' output): ``mtp_inputs`` [D, batch, seq] holds at position t the token
        t+k that depth k reads. Returns each depth's hidden state after its own norm [D, batch, seq, hidden]
        (what :meth:`head` takes: depth k's logits predict token t+k+1) and the MoE blocks' router stats
        (a leading [D] axis; None for a dense model). The depths run in order, one scanned step each."""
        rope = self.rope(positions)
        graphdef, state = nnx.split(self.mtp)

        def depth(h, xs):
            module_state, tokens = xs
            module = nnx.merge(graphdef, module_state)
            h, stats = module(h, self.embed_tokens(tokens), rope, segment_ids)
            return h, (module.norm(h), stats)

        if self.cfg.remat != "none":
            depth = jax.checkpoint(depth, policy=remat.POLICIES[self.cfg.remat], prevent_cse=False)
        return jax.lax.scan(depth, h, (state, mtp_inputs))[1]

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, index, start: jax.Array
                       ) -> tuple[jax.Array, KVCache]:
        """Decoding: logits ``[batch, s, vocab]`` (fp32) of ``tokens [batch, s]`` written at cache slots
        ``index..index+s-1`` (RoPE ``positions [batch, s]``), and the updated cache; ``start [batch]`` is each
        row's first real slot (left padding before it is never attended to). The training blocks run as in
        :meth:`run_layers`, their attention against the cache (:mod:`jaxtron.model.cache`)."""
        index = jnp.asarray(index, jnp.int32)
        x = self.embed_tokens(tokens)
        rope = self.rope(positions)
        mask = cache_mask(start.astype(jnp.int32), index, tokens.shape[1], cache.k.shape[2])
        ks, vs, first = [], [], 0
        for key, units, per_unit in layer_stacks(self.cfg):
            graphdef, state = nnx.split(getattr(self, key))
            # this stack's layers of the [num_layers, ...] cache, one [per_unit, ...] slice per scanned unit
            take = lambda c: c[first:first + units * per_unit].reshape(
                (units,) + ((per_unit,) if per_unit > 1 else ()) + c.shape[1:])

            def block(x, xs, graphdef=graphdef):
                layer_state, k, v = xs
                x, kv = nnx.merge(graphdef, layer_state)(x, rope, None, LayerCache(k, v, index, mask))
                return x, kv

            x, (k, v) = jax.lax.scan(block, x, (state, take(cache.k), take(cache.v)))
            ks.append(k.reshape((units * per_unit,) + k.shape[1 + (per_unit > 1):]))
            vs.append(v.reshape((units * per_unit,) + v.shape[1 + (per_unit > 1):]))
            first += units * per_unit
        k, v = (ks[0], vs[0]) if len(ks) == 1 else (jnp.concatenate(ks), jnp.concatenate(vs))
        return self.logits(x), KVCache(k, v)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: [batch, seq, hidden] -> fp32 logits [batch, seq, vocab]."""
        return self.head(self.final_norm(x))

    def head_weight(self, gathered: bool = False) -> jax.Array:
        """The LM head [hidden, vocab] (the embedding's transpose when tied) in the parameter dtype, as its
        matmul reads it (:func:`~jaxtron.parallel.sharding.matmul_weight`). ``gathered``: split over ``vocab``
        only, i.e. gathered over the axes that split parameters alone (FSDP); for a loss that applies
        :meth:`head` chunk by chunk, so the head is gathered once (and its gradient reduced once) per
        micro batch rather than once per chunk."""
        if self.cfg.tie_embeddings:
            w = matmul_weight(self.embed[...], ("vocab", "embed")).T
        else:
            w = matmul_weight(self.lm_head[...], ("embed", "vocab"))
        return constrain(w, (None, "vocab")) if gathered else w

    def head(self, x: jax.Array, weight: Optional[jax.Array] = None) -> jax.Array:
        """The LM head on final-normed hidden states: [batch, seq, hidden] -> fp32 logits [batch, seq, vocab].
        ``weight``: :meth:`head_weight`, when the caller read it already (cast to the compute dtype here)."""
        weight = self.head_weight() if weight is None else weight
        logits = self.matmuls.project("bsd,dv->bsv", x, weight.astype(x.dtype), jnp.float32)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))
