"""Mixture-of-Experts (issue 24): config validation, routing against a numpy reference, dispatch, the
aux-loss-free bias (moved by the train step, checkpointed), the expert loads summed over micro batches, and
equality with one device on data 2 x fsdp 2 x tensor 2 and through 1F1B and circular pipeline stages (stage 2 x
data 2 x tensor 2). Expert parallelism: test_expert_parallel.py; an MoE model's MTP block: test_mtp.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import NONZERO_LR, moe_training_record, synthetic_batch, tiny_config
from jaxtron import config as config_lib
from jaxtron.config.model_schema import MoEConfig
from jaxtron.model import routing
from jaxtron.model.moe import MoE
from jaxtron.parallel.expert import capacity
from jaxtron.train.__main__ import main

MOE = ["model.moe.num_experts=4", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32"]

BAD_MOE = [
    (["model.moe.num_experts_per_token=5"], "model.moe.num_experts_per_token"),
    (["model.moe.dispatch=sparse"], "model.moe.dispatch"),
    (["model.moe.score_func=relu"], "model.moe.score_func"),
    (["model.moe.n_group=3"], "model.moe.n_group"),                         # 3 groups do not divide 4 experts
    (["model.moe.n_group=4"], "model.moe.n_group"),                         # one expert per group
    (["model.moe.n_group=2", "model.moe.topk_group=3"], "model.moe.topk_group"),
    (["model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.num_experts_per_token=3"],
     "model.moe.num_experts_per_token"),
    (["model.moe.layer_freq=3"], "model.moe.layer_freq"),                   # 4 layers
    (["model.moe.first_dense_layers=4"], "model.moe.first_dense_layers"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
    (["model.moe.aux_loss_coef=-1"], "model.moe.aux_loss_coef"),
    (["model.moe.shared_expert_gate=true"], "model.moe.shared_expert_gate"),  # no shared experts
    (["model.moe.num_experts=-1"], "model.moe.num_experts"),
    (["model.moe.first_dense_layers=1", "parallel.stage=2"], "parallel.stage"),  # 1 MoE unit, 2 stages
    (["model.moe.gmm_impl=pallas", "model.moe.dispatch=capacity"], "model.moe.gmm_impl"),  # no grouped matmul
]


@pytest.mark.parametrize("overrides,field", BAD_MOE, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_moe_configs_give_one_line_naming_the_field(overrides, field, capsys):
    assert main(MOE + overrides) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {field}"), err


def test_good_moe_configs_validate():
    cfg = config_lib.load(None, MOE + ["model.moe.first_dense_layers=2", "model.moe.layer_freq=2",
                                       "model.moe.n_group=2", "model.moe.topk_group=1",
                                       "model.moe.score_func=sigmoid", "model.moe.aux_free_bias=true"])
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.layer_freq == 2
    assert config_lib.load().model.moe.num_experts == 0  # dense by default


# ---------------------------------------------------------------------------------------------------------------
# Routing and dispatch against direct numpy references
# ---------------------------------------------------------------------------------------------------------------

def _np_route(x, w, m: MoEConfig, bias=None):
    """Top-k routing written out token by token in float64."""
    logits = x.astype(np.float64) @ w.astype(np.float64)
    if m.score_func == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    experts, weights = [], []
    e = logits.shape[1]
    per = e // m.n_group
    for t in range(len(x)):
        sel = scores[t] + (0 if bias is None else bias)
        if m.n_group > 1:
            gscore = [np.sort(sel[g * per:(g + 1) * per])[-2:].sum() for g in range(m.n_group)]
            groups = np.argsort(gscore)[::-1][:m.topk_group]
            sel = np.where(np.isin(np.arange(e) // per, groups), sel, -np.inf)
        top = np.argsort(sel)[::-1][:m.num_experts_per_token]
        wt = scores[t, top]
        if m.norm_topk_prob:
            wt = wt / wt.sum()
        experts.append(top)
        weights.append(wt * m.routed_scaling_factor)
    return np.array(experts), np.array(weights)


ROUTINGS = {
    "softmax-renorm": dict(score_func="softmax", norm_topk_prob=True),
    "softmax-raw": dict(score_func="softmax", norm_topk_prob=False),
    "sigmoid-grouped-bias": dict(score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_routing_matches_numpy(name):
    m = MoEConfig(num_experts=8, num_experts_per_token=3, **ROUTINGS[name])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=8).astype(np.float32) if m.score_func == "sigmoid" else None
    r = routing.route(jnp.asarray(x), jnp.asarray(w), m, None if bias is None else jnp.asarray(bias))
    experts, weights = _np_route(x, w, m, bias)
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_allclose(np.asarray(r.weights), weights, rtol=1e-5)
    if name == "softmax-renorm":  # Mixtral: renormalized top-k of the softmax = softmax of the top-k logits
        np.testing.assert_allclose(np.asarray(r.weights).sum(-1), 1.0, rtol=1e-6)


def _moe_cfg(*overrides):
    cfg = tiny_config("model.moe.num_experts=4", "model.moe.num_experts_per_token=2",
                      "model.moe.expert_intermediate_size=32", *overrides)
    return cfg.model


def _np_moe(layer: MoE, x, drop=None):
    """The MoE output token by token: sum over chosen (and not dropped) experts of weight * SwiGLU_e(x)."""
    p = {k: np.asarray(getattr(layer, k)[...], np.float64) for k in ("router", "w_gate", "w_up", "w_down")}
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    experts, weights = _np_route(tokens, p["router"], layer.moe)
    out = np.zeros_like(tokens)
    silu = lambda v: v / (1 + np.exp(-v))
    for t in range(len(tokens)):
        for j, (e, wt) in enumerate(zip(experts[t], weights[t])):
            if drop is not None and drop[t, j]:
                continue
            h = silu(tokens[t] @ p["w_gate"][e]) * (tokens[t] @ p["w_up"][e])
            out[t] += wt * (h @ p["w_down"][e])
    return out.reshape(x.shape), experts


def _layer(cfg) -> MoE:
    with nnx.use_eager_sharding(False):  # a lone layer on the default device, as Llama creates its layers
        return MoE(cfg, rngs=nnx.Rngs(0))


def _x(shape=(4, 16, 64), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def test_dropless_matches_token_by_token_reference():
    layer = _layer(_moe_cfg())
    x = _x()
    y, stats = layer(x)
    ref, experts = _np_moe(layer, np.asarray(x))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["load"]), np.bincount(experts.ravel(), minlength=4))
    assert float(stats["dropped"]) == 0.0


def test_capacity_with_room_for_all_equals_dropless():
    cfg = _moe_cfg("model.moe.dispatch=capacity", "model.moe.capacity_factor=4.0")  # C = T*k: nothing drops
    dropless = _layer(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="dropless")))
    cap = _layer(cfg)
    x = _x()
    (y1, _), (y2, s2) = dropless(x), cap(x)
    assert float(s2["dropped"]) == 0.0
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y1), rtol=1e-5, atol=1e-7)


def test_capacity_drops_exactly_the_assignments_over_capacity():
    factor = 0.5
    layer = _layer(_moe_cfg("model.moe.dispatch=capacity", f"model.moe.capacity_factor={factor}"))
    x = _x()
    y, stats = layer(x)
    tokens = np.asarray(x).reshape(-1, 64)
    experts, _ = _np_route(tokens, np.asarray(layer.router[...]), layer.moe)
    t, k = experts.shape
    c = capacity(t, k, 4, 1, factor)
    # direct count, first choices before second choices, each in token order
    drop, seen = np.zeros((t, k), bool), np.zeros(4, int)
    for j in range(k):
        for tok in range(t):
            e = experts[tok, j]
            drop[tok, j] = seen[e] >= c
            seen[e] += 1
    assert drop.sum() > 0
    assert float(stats["dropped"]) / float(stats["assigned"]) == pytest.approx(drop.sum() / drop.size)
    ref, _ = _np_moe(layer, np.asarray(x), drop)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-6)


def test_aux_losses_match_their_formulas():
    layer = _layer(_moe_cfg())
    x = _x()
    _, stats = layer(x)
    tokens = np.asarray(x, np.float64).reshape(-1, 64)
    logits = tokens @ np.asarray(layer.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts, _ = _np_route(tokens, np.asarray(layer.router[...]), layer.moe)
    f = np.bincount(experts.ravel(), minlength=4) / experts.size
    assert float(stats["aux_loss"]) == pytest.approx(4 * np.sum(f * probs.mean(0)), rel=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(stats["z_loss"]) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The aux-loss-free bias
# ---------------------------------------------------------------------------------------------------------------

def test_aux_free_bias_moves_toward_balance():
    m = MoEConfig(num_experts=8, num_experts_per_token=2, score_func="sigmoid", aux_free_bias=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype(np.float32)
    x[:, 0] = 1.0
    w = rng.normal(scale=0.1, size=(16, 8)).astype(np.float32)
    w[0, :2] = 1.0  # skewed: a constant feature makes experts 0 and 1 everyone's first choices
    x = jnp.asarray(x)
    params = {"layers": {"mlp": {routing.BIAS_NAME: jnp.zeros((1, 8), jnp.float32)}}}
    imbalance = []
    for _ in range(50):
        bias = params["layers"]["mlp"][routing.BIAS_NAME][0]
        load = routing.expert_load(routing.route(x, jnp.asarray(w), m, bias).experts, 8)
        imbalance.append(float(jnp.max(load) / jnp.mean(load)))
        params = routing.update_expert_bias(params, load[None], 0.01)
    assert imbalance[0] > 3.5, imbalance[0]  # 4.0 when every token picks experts 0 and 1
    assert max(imbalance[-5:]) < 0.6 * imbalance[0], imbalance


# ---------------------------------------------------------------------------------------------------------------
# Parallel layouts equal one device
# ---------------------------------------------------------------------------------------------------------------

# 5 layers: the dense first one (run before any pipeline stage) and 4 MoE layers, 2 or (circular) 1 per chunk;
# the aux-free bias moves fast, so the later steps' routing depends on every layer's load reaching its own bias
PARALLEL_MOE = (*MOE, "model.num_layers=5", "model.moe.first_dense_layers=1", "model.moe.num_shared_experts=1",
                "model.moe.shared_expert_gate=true", "model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=0.01",
                "model.moe.aux_free_bias=true", "model.moe.bias_update_rate=0.05", *NONZERO_LR)
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_load_max_over_mean")


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def one_device():
    """The reference of every layout: one device accumulating 2 micro batches of 4 (the load-balancing loss is
    per micro batch, so each layout runs 2 micro batches too)."""
    return _moe_record(tiny_config(*PARALLEL_MOE, "parallel.data=1", "train.micro_batch_size=4"),
                       jax.devices()[:1])


def _moe_record(cfg, devices):
    return moe_training_record(cfg, devices, MOE_METRICS)[0]


@pytest.mark.slow
def test_dropless_moe_on_data2_fsdp2_tensor2_equals_one_device(one_device):
    """Losses over 3 steps with a non-zero learning rate, every gradient leaf (router, experts, shared expert
    and its gate, the dense first layer) and the router losses and loads: relative 1e-5 in fp32. The aux and z
    losses carry non-zero coefficients, so their gradients are part of the comparison."""
    from helpers import assert_same_training

    one = one_device
    eight = _moe_record(tiny_config(*PARALLEL_MOE, "parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                                    "train.micro_batch_size=1"), jax.devices())
    assert_same_training(eight, one)
    np.testing.assert_allclose(eight["moe"], one["moe"], rtol=1e-5)
    np.testing.assert_allclose(eight["bias"], one["bias"], atol=1e-6)
    assert set(one["grads"]["layers"]["mlp"]) >= {"router", "w_gate", "w_up", "w_down", "shared", "shared_gate"}
    assert "dense_layers" in one["grads"]




@pytest.mark.slow
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("circular", 2)])
def test_dropless_moe_through_pipeline_stages_equals_one_device(one_device, schedule, virtual):
    """stage 2 x data 2 x tensor 2, 2 micro batches, against one device accumulating the same 2 micro batches
    (the load-balancing loss is per micro batch): losses, every gradient leaf and the router metrics, with
    the router losses' gradients reaching the stages through the 1F1B backward (manual VJPs) and through the
    differentiated circular loop, and the expert loads of every stage's layers updating their own biases.
    (gpipe runs the circular loop with one chunk per stage.)"""
    from helpers import assert_same_training

    one = one_device
    cfg = tiny_config(*PARALLEL_MOE, "parallel.stage=2", "parallel.data=2", "parallel.tensor=2",
                      "train.micro_batch_size=2", f"parallel.pipeline_schedule={schedule}",
                      f"parallel.virtual_stages={virtual}")
    eight = _moe_record(cfg, jax.devices())
    assert_same_training(eight, one)
    np.testing.assert_allclose(eight["moe"], one["moe"], rtol=1e-5)
    np.testing.assert_allclose(eight["bias"], one["bias"], atol=1e-6)  # each layer's bias from its own load
    assert len({tuple(row) for row in one["bias"]}) > 1, one["bias"]     # and the layers' biases differ


def test_gmm_impl_pallas_needs_a_gpu_or_the_cpu_interpreter():
    from jaxtron.model import kernels

    cfg = tiny_config(*MOE, "model.moe.gmm_impl=pallas")
    kernels.check(cfg, "gpu")
    kernels.check(cfg, "cpu")
    with pytest.raises(config_lib.ConfigError, match="^model.moe.gmm_impl: 'pallas' kernels are Triton"):
        kernels.check(cfg, "tpu")


def test_gmm_impl_pallas_runs_the_grouped_matmul_kernel():
    layer = _layer(_moe_cfg("model.moe.gmm_impl=pallas"))
    graphdef, state = nnx.split(layer)
    jaxpr = str(jax.make_jaxpr(lambda st, x: nnx.merge(graphdef, st)(x))(state, _x()))
    assert jaxpr.count("pallas_call") == 3 and "ragged_dot" not in jaxpr   # gate, up, down


@pytest.mark.slow
def test_pallas_grouped_matmul_gives_the_ragged_dot_loss_and_gradients():
    """model.moe.gmm_impl=pallas (the grouped-matmul kernels, interpreted on CPU) on the data 2 x fsdp 2 x tensor
    2 mesh against ragged_dot on one device: the loss and every gradient leaf within 1e-5 relative (fp32)."""
    from jaxtron.train.trainer import Trainer, put_batch

    def loss_and_grads(cfg, devices):
        trainer = Trainer(cfg, devices)
        grads, metrics = trainer.gradients(put_batch(synthetic_batch(cfg, 0), trainer.batch_sharding))
        return float(metrics["loss"]), jax.tree.map(lambda g: np.asarray(g, np.float64), grads)

    small = (*MOE, "model.num_layers=1")
    loss, grads = loss_and_grads(tiny_config(*small, "parallel.data=1"), jax.devices()[:1])
    mesh = ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "model.moe.gmm_impl=pallas")
    pallas_loss, pallas_grads = loss_and_grads(tiny_config(*small, *mesh), jax.devices())
    assert pallas_loss == pytest.approx(loss, rel=1e-5)
    assert {"w_gate", "w_up", "w_down", "router"} <= set(grads["layers"]["mlp"])
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(pallas_grads)):
        err = np.linalg.norm(a - e) / np.linalg.norm(e)
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative difference {err:.1e}"


def test_cached_decoding_of_grouped_moe_layers_equals_the_full_forward():
    """first_dense_layers=1 and layer_freq=3 (a dense stack, then a scanned group of 2 dense + 1 MoE): the
    KV-cache path hands each stack its slice of the cache and gives the logits of the plain forward."""
    from jaxtron.model.llama import Llama
    from jaxtron.model.cache import init_cache
    from jaxtron.model.llama import layer_stacks

    cfg = tiny_config(*MOE, "model.num_layers=4", "model.moe.first_dense_layers=1", "model.moe.layer_freq=3").model
    assert layer_stacks(cfg) == [("dense_layers", 1, 1), ("layers", 1, 3)]
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda st, t, p: nnx.merge(graphdef, st)(t, p))(state, tokens, positions)
    cached = jax.jit(lambda st, *a: nnx.merge(graphdef, st).forward_cached(*a))  # jitted: eager is far slower
    start = jnp.zeros((2,), jnp.int32)
    # two chunks of the same length: one compile of the cached forward serves both (the offset is traced)
    first, cache = cached(state, tokens[:, :4], positions[:, :4], init_cache(cfg, 2, 8), 0, start)
    rest, cache = cached(state, tokens[:, 4:], positions[:, 4:], cache, 4, start)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), full, rtol=1e-5, atol=1e-5)
    assert cache.k.shape[0] == 4


@pytest.mark.parametrize("preset", ["mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v3_small"])
def test_flops_count_active_experts_as_megatron(preset):
    """Megatron's num_floating_point_operations with MoE (routed top-k + shared experts, dense layers at their
    own width) plus the router's 2 * hidden * E per MoE layer, which jaxtron counts and Megatron does not."""
    from jaxtron.train.flops import flops_per_token, moe_layer_count

    m = config_lib.load(preset).model
    # the MoE terms only: deepseek_v3_small's MLA attention and MTP module are counted apart (test_mla, test_mtp)
    m = dataclasses.replace(m, mla=dataclasses.replace(m.mla, kv_lora_rank=0),
                            mtp=dataclasses.replace(m.mtp, num_layers=0))
    e, h, L, s = m.moe, m.hidden_size, m.num_layers, 4096
    n_moe = moe_layer_count(m)
    hd = config_lib.head_dim(m)
    attn = (1 + m.num_kv_heads / m.num_heads + s / h) * hd * m.num_heads / h
    shared = e.num_shared_experts * (e.shared_expert_intermediate_size or e.expert_intermediate_size)
    mlp = ((L - n_moe) * m.intermediate_size + n_moe * (e.expert_intermediate_size * e.num_experts_per_token
                                                         + shared)) * 1.5 / (L * h)
    megatron = 12 * L * h * h * (attn + mlp + m.vocab_size / (2 * L * h))
    router = 3 * 2 * h * e.num_experts * n_moe
    assert flops_per_token(m, s) == pytest.approx(megatron + router, rel=1e-12)
    assert router < 0.005 * megatron


@pytest.mark.slow
def test_gradient_accumulation_sums_the_expert_load_and_the_bias_is_checkpointed(one_device, tmp_path):
    """one_device's 2 micro batches of 4 against the whole batch of 8 in one: the same first-step loss and
    z-loss (per-token means) and the same max/mean expert load, which is only so if the step sums the loads of
    all micro batches. (The load-balancing loss is computed per micro batch, as Megatron does, so it differs.)
    The aux-free biases, zero at first, are moved by that step (by the loads, not by gradients); a checkpoint
    restores them and every other parameter bit for bit."""
    from jaxtron.checkpoint import Checkpointer
    from jaxtron.train.trainer import Trainer, put_batch

    cfg = tiny_config(*PARALLEL_MOE, "parallel.data=1", "train.micro_batch_size=8")
    run = Trainer(cfg, jax.devices()[:1])
    get_bias = lambda state: np.asarray(state["params"]["layers"]["mlp"][routing.BIAS_NAME])  # noqa: E731
    assert not get_bias(run.state).any()
    m = run.step(put_batch(synthetic_batch(cfg, 0), run.batch_sharding))
    whole = dict(zip(MOE_METRICS, one_device["moe"][0]))
    assert float(m["loss"]) == pytest.approx(one_device["losses"][0], rel=1e-5)
    assert float(m["moe_z_loss"]) == pytest.approx(whole["moe_z_loss"], rel=1e-5)
    assert float(m["moe_load_max_over_mean"]) == pytest.approx(whole["moe_load_max_over_mean"], rel=1e-6)
    assert float(m["moe_dropped"]) == 0.0

    bias = get_bias(run.state)
    assert bias.shape == (4, 4) and np.abs(bias).max() > 0  # a sign update of 0.05, one row per MoE layer
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, run.state, {})
    ckpt.wait()
    restored, _ = ckpt.restore(1, run.spec.abstract_state)
    ckpt.close()
    np.testing.assert_array_equal(get_bias(restored), bias)  # bit for bit
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored["params"], jax.device_get(run.state["params"]))


def test_gmm_impl_auto_is_the_kernel_on_gpus_and_ragged_dot_elsewhere():
    """The default model.moe.gmm_impl=auto resolves by the devices the program is built for: the grouped-GEMM
    kernel in a GPU program (ragged_dot there multiplies every row by every expert), XLA's exact op on CPU."""
    from jaxtron.config import gmm_impl
    from jaxtron.model.projection import Matmuls

    cfg = tiny_config(*MOE).model
    assert cfg.moe.gmm_impl == "auto"
    with nnx.use_eager_sharding(False):
        assert MoE(cfg, rngs=nnx.Rngs(0), matmuls=Matmuls(cpu=False)).gmm_impl == "pallas"
        assert MoE(cfg, rngs=nnx.Rngs(0), matmuls=Matmuls(cpu=True)).gmm_impl == "ragged_dot"
    for chosen in ("pallas", "ragged_dot"):
        assert gmm_impl(tiny_config(*MOE, f"model.moe.gmm_impl={chosen}").model, gpu=True) == chosen
