"""The rules table (jaxtron/parallel/rules.py) and the logical axis names the code uses agree both ways: every
name a model uses has a rule (a name without one would be silently replicated), and every rule is used by some
model (a rule nothing uses is dead, or names something that was renamed).

The names are collected, not scanned from the source, so the test cannot drift from the code:

- parameters: the ``out_sharding`` metadata of every Variable of abstractly initialized models
  (``nnx.eval_shape``, read with ``jaxtron.parallel.sharding.logical_names``);
- activations: every name looked up in the rules while the forward, its gradient and a KV-cached decoding step
  are traced (``jax.eval_shape``, nothing compiled) under each layout's rules and mesh. The rules are read in
  one place, ``jaxtron.parallel.sharding.logical_to_spec`` (via flax's ``logical_to_mesh_axes``, recorded here), by
  ``constrain``, ``per_shard``, the context-parallel attention of ``parallel/ring_attention.py`` and the rest.

The models: dense Llama, Qwen2 (QKV bias), Qwen3 (Q/K norms), an MoE with leading dense layers, grouped layers
(layer_freq 2) and a gated shared expert, and the DeepSeek-V3-style preset (configs/deepseek_v3_small.yaml at
tiny widths: sigmoid group-limited routing, aux-free bias), and Multi-head Latent Attention (its cache too); the
layouts: data x fsdp x tensor, sequence parallelism, context parallelism under each ``parallel.context_impl``
(the names inside attention differ), and expert parallelism. The Pallas kernels' names (``per_shard`` over
q/k/v) and FP8 (delayed histories, blockwise GEMM letters) are traced too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import nnx

from helpers import tiny_config
from jaxtron.model.cache import init_cache
from jaxtron.model.llama import Llama
from jaxtron.parallel import sharding
from jaxtron.parallel.layout import Layout

SMALL = ("model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=64",
         "model.vocab_size=256", "data.seq_len=8", "train.global_batch_size=8")
MOE = ("model.moe.num_experts=4", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32")
DEEPSEEK_SMALL = ("model.num_layers=2", "model.moe.num_experts=8", "model.moe.expert_intermediate_size=16",
                  "model.moe.n_group=4", "model.moe.topk_group=2", "model.moe.num_experts_per_token=2",
                  "model.attention_impl=xla", "model.dtype=float32", "model.remat=none")
DP = ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")
CP = ("parallel.data=2", "parallel.context=2", "parallel.tensor=2")

# name: (preset or None for the tiny defaults, overrides); each model once per layout family that changes the
# names it is traced with
CASES = {
    "llama-dp-fsdp-tp": (None, DP),
    "llama-sequence-parallel": (None, DP + ("parallel.sequence_parallel=true",)),
    "llama-context-all_gather": (None, CP + ("parallel.context_impl=all_gather",)),
    "llama-context-ring": (None, CP + ("parallel.context_impl=ring",)),
    "qwen3-context-ulysses": (None, CP + ("parallel.context_impl=ulysses", "model.qk_norm=true")),
    "qwen2-pallas-kernels": (None, DP + ("model.qkv_bias=true", "model.hidden_size=64", "model.attention_impl=pallas",
                                         "model.rope_impl=pallas", "model.mlp_impl=pallas")),
    "llama-fp8-delayed": (None, DP + ("model.fp8=delayed",)),
    "llama-fp8-blockwise": (None, DP + ("model.fp8=blockwise", "model.hidden_size=128",
                                        "model.intermediate_size=128", "model.num_heads=2", "model.num_kv_heads=2")),
    "moe-dense-first-grouped-shared-ep": (None, MOE + (
        "model.num_layers=3", "model.moe.first_dense_layers=1", "model.moe.layer_freq=2",
        "model.moe.num_shared_experts=1", "model.moe.shared_expert_gate=true", "parallel.data=2",
        "parallel.expert=2", "parallel.tensor=2")),
    "mla-dp-fsdp-tp": (None, DP + ("model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=16",
                                   "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8",
                                   "model.mla.v_head_dim=8", "model.num_kv_heads=4")),
    "deepseek_v3_small-ep": ("deepseek_v3_small", DEEPSEEK_SMALL + (
        "parallel.data=2", "parallel.fsdp=1", "parallel.expert=4", "parallel.tensor=1", "model.mtp.num_layers=1")),
}


def _config(case: str):
    from jaxtron import config as config_lib

    preset, overrides = CASES[case]
    if preset is None:
        return tiny_config(*SMALL, *overrides)
    return config_lib.load(preset, list(SMALL) + ["train.micro_batch_size=null", "logging.progress=false",
                                                 "logging.tensorboard=false"] + list(overrides))


def _names_of(tree) -> set[str]:
    out = set()
    for spec in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        out.update(n for n in spec if n is not None)
    return out


@functools.lru_cache(maxsize=None)
def _used(case: str) -> tuple[frozenset, frozenset, frozenset]:
    """(parameter names, activation names, the layout's rule names) of one case."""
    cfg = _config(case)
    layout = Layout.build(cfg)
    abstract = nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0)))
    params = _names_of(sharding.logical_names(nnx.state(abstract)))
    graphdef, state = nnx.split(abstract)
    b, s = cfg.train.global_batch_size, cfg.data.seq_len
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def loss(state, tokens):
        model = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        logits, _ = model.forward_with_stats(tokens, positions, jnp.ones((b, s), jnp.int32))
        return jnp.mean(logits)

    def decode(state, tokens):
        model = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        cache = init_cache(cfg.model, b, 2 * s, jnp.float32)  # MLA's holds latents and rope keys
        return model.forward_cached(tokens, positions, cache, 0, jnp.zeros((b,), jnp.int32))

    seen: set = set()
    original = nn.logical_to_mesh_axes

    def recording(names, rules=None):
        seen.update(n for n in names if n is not None)
        return original(names, rules)

    sharding.nn.logical_to_mesh_axes = recording
    try:
        with layout.tracing():
            jax.eval_shape(jax.grad(loss), state, tokens)
            jax.eval_shape(decode, state, tokens)
    finally:
        sharding.nn.logical_to_mesh_axes = original
    assert seen, "no logical name was looked up while tracing: the recorder no longer sees sharding.logical_to_spec"
    return frozenset(params), frozenset(seen - params), frozenset(name for name, _ in layout.rules)


@pytest.mark.parametrize("case", list(CASES))
def test_every_name_a_model_uses_has_a_rule(case):
    params, activations, rules = _used(case)
    assert {"embed", "heads", "layers"} <= params and {"act_batch", "act_embed"} <= activations
    assert not params - rules, f"{case}: parameter names without a rule in parallel/rules.py: {params - rules}"
    assert not activations - rules, f"{case}: activation names without a rule: {activations - rules}"


def test_every_rule_is_used_by_some_model():
    used = set().union(*(p | a for p, a, _ in map(_used, CASES)))
    rules = set().union(*(r for _, _, r in map(_used, CASES)))
    assert not rules - used, f"rules in parallel/rules.py that no model or layout uses: {sorted(rules - used)}"


def test_the_cases_use_what_their_configs_name():
    """The cases really exercise what they are there for (the rules a config switches on)."""
    assert "dense_layers" in _used("moe-dense-first-grouped-shared-ep")[0]
    assert {"experts", "router_experts"} <= _used("deepseek_v3_small-ep")[0]
    assert {"mtp_layers", "mtp_in"} <= _used("deepseek_v3_small-ep")[0]  # the MTP module's stack
    assert "act_attn_head_exchange" in _used("qwen3-context-ulysses")[1]
    assert {"act_attn_seq", "act_kv_seq"} <= _used("llama-context-ring")[1]
    assert "act_res_seq" in _used("llama-sequence-parallel")[1]
