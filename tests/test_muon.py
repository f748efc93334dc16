"""optim.name=muon: which leaves are orthogonalised and how, two optimizer steps against a numpy reference, and
equality of a sharded layout (fsdp x tensor x data, and expert parallelism) with one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import NONZERO_LR, assert_same_params, assert_same_training, tiny_config, training_record_with_params
from jaxtron.config import ConfigError, OptimConfig
from jaxtron.train.muon import dimension_numbers, labels
from jaxtron.train.optimizer import make_optimizer

NS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic coefficients, optax's default

# a small tree with every kind of leaf: a stacked attention (fan-in first and fan-out first), stacked experts,
# norm, bias, embedding, head, router
NAMES = {
    "embed": P("vocab", "embed"), "lm_head": P("embed", "vocab"),
    "layers": {"wq": P("layers", "embed", "heads", "head_dim"), "wo": P("layers", "heads", "head_dim", "embed"),
               "bq": P("layers", "heads", "head_dim"), "scale": P("layers", "norm"),
               "router": P("layers", "embed", "router_experts"),
               "w_down": P("layers", "experts", "mlp", "embed")},
}
SHAPES = {"embed": (16, 8), "lm_head": (8, 16),
          "layers": {"wq": (2, 8, 4, 3), "wo": (2, 4, 3, 8), "bq": (2, 4, 3), "scale": (2, 8),
                     "router": (2, 8, 3), "w_down": (2, 3, 5, 8)}}
MUON = {"wq": ((1,), (2, 3)), "wo": ((1, 2), (3,)), "w_down": ((2,), (3,))}  # (fan-in axes, fan-out axes)


def test_which_leaves_and_axes():
    got = labels(NAMES)
    assert got["embed"] == got["lm_head"] == "adam"
    assert {k: v for k, v in got["layers"].items() if v == "muon"}.keys() == MUON.keys()
    for key, (fan_in, fan_out) in MUON.items():
        d = dimension_numbers(NAMES["layers"][key])
        assert (tuple(d.reduction_axis), tuple(d.output_axis)) == (fan_in, fan_out)


def _newton_schulz(x):
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(5):
        a = x @ x.T
        x = NS[0] * x + (NS[1] * a + NS[2] * a @ a) @ x
    return x.T if transposed else x


def _orthogonalise(m, fan_in, fan_out):
    batch = [i for i in range(m.ndim) if i not in fan_in + fan_out]
    t = np.transpose(m, batch + list(fan_in) + list(fan_out))
    rows, cols = np.prod([m.shape[i] for i in fan_in]), np.prod([m.shape[i] for i in fan_out])
    flat = t.reshape(-1, rows, cols)
    out = np.stack([_newton_schulz(x) for x in flat]).reshape(t.shape)
    return np.transpose(out, np.argsort(batch + list(fan_in) + list(fan_out))), rows, cols


def _reference_steps(o, params, grads_per_step, lr):
    """Muon (optax's Nesterov form with bias correction) on MUON's leaves, AdamW elsewhere; float64."""
    params = jax.tree.map(np.float64, params)
    mu = jax.tree.map(np.zeros_like, params)
    nu = jax.tree.map(np.zeros_like, params)
    for t, grads in enumerate(grads_per_step, start=1):
        new = {}
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            keys = tuple(k.key for k in path)
            get = lambda tree: tree[keys[0]] if len(keys) == 1 else tree[keys[0]][keys[1]]
            g, m, v = np.float64(get(grads)), get(mu), get(nu)
            if keys[-1] in MUON:
                b = o.muon_beta
                m[...] = b * m + (1 - b) * g
                m_hat = b * m / (1 - b ** (t + 1)) + (1 - b) * g / (1 - b ** t)
                u, rows, cols = _orthogonalise(m_hat, *MUON[keys[-1]])
                u = u * o.muon_rms * np.sqrt(max(rows, cols)) + o.weight_decay * p
            else:
                m[...] = o.beta1 * m + (1 - o.beta1) * g
                v[...] = o.beta2 * v + (1 - o.beta2) * g * g
                m_hat, v_hat = m / (1 - o.beta1 ** t), v / (1 - o.beta2 ** t)
                u = m_hat / (np.sqrt(v_hat) + o.eps)
                if keys[-1] not in ("scale", "bq"):
                    u = u + o.weight_decay * p
            new[keys] = p - lr * u
        params = jax.tree_util.tree_map_with_path(lambda path, _: new[tuple(k.key for k in path)], params)
    return params


def test_two_steps_match_numpy_reference():
    o = dataclasses.replace(OptimConfig(), name="muon", schedule="constant", warmup_steps=0, grad_clip=0.0,
                            lr=0.01, weight_decay=0.1)
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    params = treedef.unflatten([rng.standard_normal(s).astype(np.float32) for s in leaves])
    grads = [treedef.unflatten([rng.standard_normal(s).astype(np.float32) for s in leaves]) for _ in range(2)]
    tx, _ = make_optimizer(o, 10, NAMES)
    state, p = tx.init(params), jax.tree.map(jnp.asarray, params)
    for g in grads:
        updates, state = jax.jit(tx.update)(g, state, p)
        p = jax.tree.map(jnp.add, p, updates)
    expected = _reference_steps(o, params, grads, o.lr)
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(p)):
        moved = np.linalg.norm(e - _leaf(params, path))
        err = np.linalg.norm(np.asarray(a, np.float64) - e) / moved
        assert moved > 0 and err < 1e-4, f"{jax.tree_util.keystr(path)}: relative error of the update {err:.1e}"


def _leaf(tree, path):
    for k in path:
        tree = tree[k.key]
    return np.float64(tree)


def test_bad_name_is_one_line_error():
    with pytest.raises(ConfigError, match="optim.name"):
        tiny_config("optim.name=sgd")


MOE = ("model.moe.num_experts=4", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32")
LAYOUTS = {
    "dense-data2-fsdp2-tensor2": ((), ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2")),
    "moe-expert2-fsdp2-tensor2": (MOE, ("parallel.data=1", "parallel.expert=2", "parallel.fsdp=2",
                                        "parallel.tensor=2")),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(name):
    model, layout = LAYOUTS[name]
    base = ("optim.name=muon", *model, *NONZERO_LR)
    expected = training_record_with_params(tiny_config(*base, "parallel.data=1"), jax.devices()[:1])[0]
    got = training_record_with_params(tiny_config(*base, *layout), jax.devices())[0]
    assert_same_training(got, expected, rtol=1e-5)
    assert_same_params(got["params"], expected["params"], rtol=1e-5)
