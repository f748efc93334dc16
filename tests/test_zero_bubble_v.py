"""The ``zbv`` schedule (jaxtron/parallel/zero_bubble_v_table.py, zero_bubble_v.py): its tick table against tables
worked by hand, the rules every table keeps (each F, B and W once, in dependency order, within the memory cap),
the ring slots the compiled loop reads (replayed symbolically: every read finds the value it needs), the
bubble against 1f1b's and zb_h1's, the config checks, and equality with one device: a toy chain of functions
(every gradient, 1e-6), and the tiny Llama on stage 2 x tensor 2 x data 2 (losses and gradient norms of 3
steps with a non-zero learning rate, every gradient leaf, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from helpers import NONZERO_LR, assert_same_training, tiny_config, training_record
from jaxtron.config import ConfigError, load
from jaxtron.parallel import zero_bubble_v
from jaxtron.parallel.layout import Layout
from jaxtron.parallel.pipeline_layout import PipelineSpec, chunked, unchunked
from jaxtron.parallel.zero_bubble import one_f_one_b_bubble, zb_h1_table
from jaxtron.parallel.zero_bubble_v_table import (BWD, FWD, LEFT, RIGHT, SELF, WGT, zbv_arrays, zbv_table)

# Worked by hand from the rules in zero_bubble_v_table's docstring (upper case: chunk 0, the down leg; lower
# case: chunk 1, the up leg; a value sent in tick t is there in tick t + 1). S=2, M=2, device 1: idle at 0 (F0's
# input arrives at 1), F0, then f0 (its own F0's output), F1, f1; b0 at 5 after device 0's b0 (the loss's
# cotangent came with device 0's f0 at 3, so b0 there at 4), B0 at 6 on its own b0's cotangent, ...; device 0
# idles at 2 (no F left for chunk 0, f0's input not there yet); W's only when nothing else can run.
S2_M2 = [
    ["F0", "F1", "-", "f0", "b0", "f1", "b1", "B0", "w0", "B1", "W0", "w1", "W1"],
    ["-", "F0", "f0", "F1", "f1", "b0", "B0", "b1", "B1", "w0", "W0", "w1", "W1"],
]
# Device 0 stops its F's at 4 chunk residuals (the cap, 2S): F0 F1 F2 f0, then b0 and w0 free one.
S2_M4 = [
    ["F0", "F1", "F2", "f0", "b0", "w0", "f1", "B0", "b1", "W0", "F3", "B1", "w1", "f2", "b2", "W1", "w2", "B2",
     "W2", "f3", "b3", "w3", "-", "B3", "W3"],
    ["-", "F0", "f0", "F1", "f1", "b0", "B0", "w0", "F2", "b1", "B1", "W0", "f2", "w1", "F3", "b2", "B2", "W1",
     "f3", "w2", "W2", "b3", "B3", "w3", "W3"],
]
S4_M4 = [
    ["F0", "F1", "F2", "F3", "-", "-", "-", "f0", "b0", "f1", "b1", "f2", "b2", "f3", "b3", "B0", "w0", "B1", "W0",
     "B2", "w1", "B3", "W1", "w2", "W2", "w3", "W3"],
    ["-", "F0", "F1", "F2", "F3", "-", "f0", "-", "f1", "b0", "f2", "b1", "f3", "b2", "B0", "b3", "B1", "w0", "B2",
     "W0", "B3", "w1", "W1", "w2", "W2", "w3", "W3"],
    ["-", "-", "F0", "F1", "F2", "f0", "F3", "f1", "-", "f2", "b0", "f3", "b1", "B0", "b2", "B1", "b3", "B2", "w0",
     "B3", "W0", "w1", "W1", "w2", "W2", "w3", "W3"],
    ["-", "-", "-", "F0", "f0", "F1", "f1", "F2", "f2", "F3", "f3", "b0", "B0", "b1", "B1", "b2", "B2", "b3", "B3",
     "w0", "W0", "w1", "W1", "w2", "W2", "w3", "W3"],
]


@pytest.mark.parametrize("stages,micro_batches,expected,peak", [
    (2, 2, S2_M2, (4, 4)), (2, 4, S2_M4, (4, 4)), (4, 4, S4_M4, (8, 8, 8, 8)),
])
def test_table_matches_the_hand_worked_one(stages, micro_batches, expected, peak):
    table = zbv_table(stages, micro_batches)
    assert [table.describe(d) for d in range(stages)] == expected
    assert table.peak_in_flight == peak
    idle = sum(row.count("-") for row in expected) / stages
    assert table.bubble == pytest.approx(idle / len(expected[0]))      # 6M units of work per device
    assert len(expected[0]) == 6 * micro_batches + idle


def _ticks_of(table):
    at = {}
    for t, row in enumerate(table.work):
        for d, op in enumerate(row):
            if op is not None:
                assert (*op, d) not in at, (op, d)
                at[(*op, d)] = t
    return at


@pytest.mark.parametrize("stages,micro_batches", [(1, 3), (2, 3), (3, 5), (4, 8), (8, 16)])
def test_every_table_keeps_the_dependencies_and_the_cap(stages, micro_batches):
    S, M = stages, micro_batches
    table = zbv_table(S, M)
    at = _ticks_of(table)
    assert len(at) == 6 * S * M                       # F, B, W of both chunks of every micro batch, once each
    for m in range(M):
        for d in range(S):
            # the down leg's activation moves d - 1 -> d, turns on device S - 1, the up leg's moves d + 1 -> d
            if d:
                assert at["F", 0, m, d] > at["F", 0, m, d - 1]
            assert at["F", 1, m, d] > (at["F", 0, m, d] if d == S - 1 else at["F", 1, m, d + 1])
            # cotangents the other way; device 0's chunk 1 starts from the loss after its own F
            assert at["B", 1, m, d] > (at["F", 1, m, d] if d == 0 else at["B", 1, m, d - 1])
            assert at["B", 0, m, d] > (at["B", 1, m, d] if d == S - 1 else at["B", 0, m, d + 1])
            for c in (0, 1):
                assert at["W", c, m, d] > at["B", c, m, d]
    assert max(table.peak_in_flight) <= 2 * S
    assert table.ticks == len(table.work)


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_bubble_is_below_1f1b_and_zb_h1(stages, micro_batches):
    bubble = zbv_table(stages, micro_batches).bubble
    assert bubble < one_f_one_b_bubble(stages, micro_batches)
    assert bubble < zb_h1_table(stages, micro_batches).bubble


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="must be positive"):
        zbv_table(2, 0)
    with pytest.raises(ValueError, match="cap must be"):
        zbv_table(2, 4, 1)


@pytest.mark.parametrize("stages,micro_batches", [(1, 2), (2, 4), (3, 5), (4, 8)])
def test_ring_slots_replayed_give_every_op_its_values(stages, micro_batches):
    """The loop's arrays run on symbols: each device's output goes to both neighbours and itself, the recv
    table stores it or drops it; every F must read its predecessor chunk's output, every B and W the cotangent
    its successor sent (device 0's chunk 1: the loss's), and every B and W the residuals its own F wrote."""
    S, M = stages, micro_batches
    table = zbv_table(S, M)
    a = zbv_arrays(table)
    assert a.res_slots == max(table.peak_in_flight)
    bufs = [[None] * a.buf_slots for _ in range(S)]
    rings = [[None] * a.res_slots for _ in range(S)]
    out = [None] * S
    for t in range(table.ticks):
        prev, out = out, [None] * S
        for d in range(S):
            for src, dev in ((LEFT, d - 1), (RIGHT, d + 1), (SELF, d)):
                if a.recv[t, d, src] >= 0:
                    bufs[d][a.recv[t, d, src]] = prev[dev]
            op, c, m = a.op[t, d], a.chunk[t, d], a.micro[t, d]
            rs, bs = a.res_slot[t, d], a.buf_slot[t, d]
            if op == FWD:
                if not (d == 0 and c == 0):
                    pred = ("y", 0, m, d) if (c == 1 and d == S - 1) else ("y", c, m, d - 1 if c == 0 else d + 1)
                    assert bufs[d][bs] == pred, (t, d, c, m)
                rings[d][rs] = ("res", c, m)
                out[d] = ("y", c, m, d)
                if a.head_slot[t, d] >= 0:
                    bufs[d][a.head_slot[t, d]] = ("loss", m)
            elif op in (BWD, WGT):
                assert rings[d][rs] == ("res", c, m), (t, d)
                if d == 0 and c == 1:
                    succ = ("loss", m)
                elif c == 0 and d == S - 1:
                    succ = ("dx", 1, m, d)
                else:
                    succ = ("dx", c, m, d - 1 if c == 1 else d + 1)
                assert bufs[d][bs] == succ, (t, d, c, m)
                if op == BWD:
                    out[d] = ("dx", c, m, d)


def _layout(*overrides):
    return Layout.planned(load(None, ["parallel.stage=2", "parallel.data=1", "train.global_batch_size=8",
                                      "train.micro_batch_size=1", "model.num_layers=4", *overrides]), 2)


def test_planner_bubble_is_below_1f1b():
    zbv, ofob = _layout("parallel.pipeline_schedule=zbv"), _layout("parallel.pipeline_schedule=1f1b")
    assert zbv.accumulation_steps == 8
    assert zbv.bubble == pytest.approx(zbv_table(2, 8).bubble) == pytest.approx(1 / 49)
    assert zbv.bubble < ofob.bubble == pytest.approx(1 / 9)
    spec = zbv.pipeline()
    assert (spec.chunks_per_device, spec.ticks) == (2, 49)
    assert zbv.pipeline(for_eval=True).schedule == "gpipe"   # evaluation runs the forward loop


@pytest.mark.parametrize("overrides,field", [
    (("parallel.pipeline_recompute=true",), "parallel.pipeline_recompute"),
    (("model.num_layers=6",), "model.num_layers"),                     # 6 layers are not 2 x 2 chunks
])
def test_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=field):
        _layout("parallel.pipeline_schedule=zbv", *overrides)


def test_v_layout_round_trips():
    """Device d holds chunks d and 2S - 1 - d; unchunked undoes it."""
    S, L = 4, 16
    mesh = jax.make_mesh((S,), ("stage",), axis_types=(AxisType.Auto,), devices=jax.devices()[:S])
    w = jnp.arange(L * 3, dtype=jnp.float32).reshape(L, 3)
    spec = PipelineSpec(S, 4, "zbv")
    with jax.set_mesh(mesh):
        c = chunked({"w": w}, {"w": P("stage")}, spec, mesh)["w"]
    assert c.shape == (S, 2, L // (2 * S), 3)
    for d in range(S):
        np.testing.assert_array_equal(c[d, 0], w[2 * d:2 * d + 2])
        np.testing.assert_array_equal(c[d, 1], w[2 * (2 * S - 1 - d):2 * (2 * S - 1 - d) + 2])
    np.testing.assert_array_equal(unchunked({"w": c}, spec)["w"], w)


def test_toy_chain_equals_one_device():
    """zero_bubble_v.value_and_grad on a chain of small functions (an embedding, tanh layers whose objective term
    and report depend on the micro batch, a head) against autodiff of the same chain, 2 devices, 4 micro
    batches, 8 layers (chunks of 2)."""
    S, M, L, D, B = 2, 4, 8, 8, 3
    mesh = jax.make_mesh((S,), ("stage",), axis_types=(AxisType.Auto,), devices=jax.devices()[:S])
    k = jax.random.split(jax.random.key(0), 4)
    stacked = {"w": jax.random.normal(k[0], (L, D, D)) / np.sqrt(D)}
    shared = {"emb": jax.random.normal(k[1], (5, D)), "head": jax.random.normal(k[2], (D,))}
    micro = {"ids": jax.random.randint(k[3], (M, B), 0, 5)}

    def pre(sh, mb):
        return sh["emb"][mb["ids"]]

    def stage(layers, x, mb):
        def one(x, w):
            return jnp.tanh(x @ w) + x * mb["ids"][:, None], jnp.sum(x)
        x, s = jax.lax.scan(one, x, layers["w"])
        return x, (0.01 * jnp.sum(x ** 2), {"s": s})

    def post(sh, x, mb):
        return jnp.sum(jnp.sin(x @ sh["head"]) * mb["ids"]), (jnp.sum(x),)

    def total(stacked, shared):
        loss, aux, report, lc = 0.0, 0.0, [], L // (2 * S)
        for m in range(M):
            mb = jax.tree.map(lambda a: a[m], micro)
            x, rep = pre(shared, mb), []
            for c in range(2 * S):
                x, (obj, r) = stage(jax.tree.map(lambda a: a[c * lc:(c + 1) * lc], stacked), x, mb)
                loss, rep = loss + obj, rep + [r["s"]]
            term, (a,) = post(shared, x, mb)
            loss, aux = loss + term, aux + a
            report.append(jnp.concatenate(rep))
        return loss, (aux, sum(report))

    (_, (aux, report)), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(stacked, shared)
    spec = PipelineSpec(S, M, "zbv")
    with jax.set_mesh(mesh):
        ((sums,), rep), got = jax.jit(lambda st, sh, mi: zero_bubble_v.value_and_grad(
            spec, mesh, (), pre, stage, post, st, {"w": P("stage")}, sh, mi,
            lambda acc, g: jax.tree.map(jnp.add, acc, g)))(stacked, shared, micro)
    np.testing.assert_allclose(sums, aux, rtol=1e-6)
    np.testing.assert_allclose(rep["s"], report, rtol=1e-6)
    for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(got)):
        err = float(jnp.linalg.norm(have - want) / jnp.linalg.norm(want))
        assert err < 1e-6, (jax.tree_util.keystr(path), err)


def test_zbv_trains_like_one_device():
    """The tiny Llama (8 layers: 4 chunks of two layers) on stage 2 x tensor 2 x data 2, 4 micro batches. The
    one-device reference is test_pipeline.py's (the same config), so the suite compiles it once (the persistent
    compile cache)."""
    batch, micro_batches, dp = 16, 4, 2

    def config(*overrides):
        return tiny_config("model.num_layers=8", f"train.global_batch_size={batch}", *NONZERO_LR, *overrides)

    reference = training_record(config("parallel.data=1", f"train.micro_batch_size={batch // micro_batches}"),
                                jax.devices()[:1])
    cfg = config("parallel.stage=2", "parallel.tensor=2", "parallel.data=2", "parallel.pipeline_schedule=zbv",
                 f"train.micro_batch_size={batch // (micro_batches * dp)}")
    assert_same_training(training_record(cfg, jax.devices()), reference)


def test_planner_counts_zbv_memory_and_bubble():
    """Llama-3-70B on tensor 8 x stage 8, 128 micro batches: zbv's step is ranked by its smaller bubble (B and W
    split: the same matmul work as 1f1b). Its memory is its ring as allocated: under remat full 1f1b keeps 2S - 1
    stage inputs per stage, while each zbv slot also holds the stash its W reads from its B (every weight dot's
    input and output cotangent), so zbv needs more. Against XLA's compiled peaks of three zbv layouts (save_dots,
    64 H100, from `python -m jaxtron.plan --search --config configs/llama3_70b.yaml --gpu h100 --num-gpus 64
    --max-compiles 12`) the closed form comes to 0.8-1.05x; it was 0.42-0.69x without the stash, and --search
    compiled ten layouts that did not fit."""
    from jaxtron.plan import model as pm
    from jaxtron.plan.gpus import get_gpu

    def planned(schedule, *overrides, config="llama3_70b"):
        cfg = load(config, ["parallel.data=1", "parallel.fsdp=1", "parallel.tensor=8", "parallel.stage=8",
                            f"parallel.pipeline_schedule={schedule}", *overrides])
        return cfg, Layout.planned(cfg, 64)

    zbv, ofob = planned("zbv"), planned("1f1b")
    assert zbv[1].bubble < ofob[1].bubble
    assert pm.closed_form_memory(*zbv)["activations"] > pm.closed_form_memory(*ofob)["activations"]
    for overrides, compiled in (
            (("parallel.fsdp=4", "parallel.stage=2", "train.micro_batch_size=2"), 166.26e9),
            (("parallel.fsdp=4", "parallel.stage=2", "parallel.pipeline_fsdp_gather_once=true",
              "train.micro_batch_size=1"), 101.05e9),
            (("parallel.fsdp=2", "parallel.tensor=4", "parallel.stage=8", "train.micro_batch_size=1"), 131.58e9)):
        c = planned("zbv", "parallel.sequence_parallel=true", "model.remat=save_dots", *overrides,
                    config="configs/llama3_70b.yaml")
        assert 0.8 < pm.closed_form_memory(*c)["total"] / compiled < 1.05, overrides
    gpu = get_gpu("h100")
    rest = lambda c: pm.hbm_bytes(*c) / (gpu.hbm_gbps * 1e9) + pm.closed_form_comm_s(*c, gpu, 64)  # noqa: E731
    compute = {name: pm.closed_form_step_s(*c, gpu, 64) - rest(c) for name, c in (("zbv", zbv), ("1f1b", ofob))}
    assert compute["zbv"] / compute["1f1b"] == pytest.approx((1 - ofob[1].bubble) / (1 - zbv[1].bubble))
