"""Expert parallelism (parallel.expert > 1, issue 25): the experts split over the ``expert`` mesh axis and the
tokens sent to them with all-to-all (jaxtron/parallel/expert.py) train exactly as one device's dropless MoE.

On 8 CPU devices, expert 2 x fsdp 2 x tensor 2 with sequence parallelism (expert weights split over expert,
fsdp and tensor at once, each tensor rank dispatching its half of the sequence; 4 local experts per rank),
expert 4 x data 2 (2 local experts) and expert 2 with 1F1B stages 2 x data 2, at worst-case capacity: losses
over 3 steps with a non-zero learning rate, every gradient leaf, the gradient norms and the router metrics (aux
and z losses, load) to 1e-5 fp32, and nothing dropped. Without expert ranks (data 8) the dispatch's shard_map
trains the same and runs each device's own tokens only (an eighth of one device's matmul FLOPs). Every run has
2 micro batches (the pipeline needs them; the load-balancing loss is per micro batch), so one single-device
reference serves all. With a small capacity the dropped count and the layer's output equal a direct numpy
count and reference. Bad configs give one line naming the field.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import NONZERO_LR, assert_same_training, moe_training_record, tiny_config
from jaxtron import preflight
from jaxtron.config import ConfigError
from jaxtron.model.moe import MoE
from jaxtron.parallel.expert import capacity
from jaxtron.parallel.layout import Layout
from test_moe import _np_moe, _np_route

# 8 experts (one per rank at expert 8), top-2; a dense first layer and 2 MoE layers (one per pipeline stage),
# a gated shared expert and non-zero router loss coefficients, so every kind of MoE parameter has a gradient
# to compare; 16 sequences in 2 micro batches of 8
EP_MOE = ("model.moe.num_experts=8", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32",
          "model.moe.first_dense_layers=1", "model.num_layers=3", "model.moe.num_shared_experts=1",
          "model.moe.shared_expert_gate=true", "model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=0.01",
          "train.global_batch_size=16", *NONZERO_LR)
METRICS = ("moe_aux_loss", "moe_z_loss", "moe_load_max_over_mean", "moe_dropped")


def _record(cfg, devices):
    """helpers.moe_training_record with this file's metrics: (record, trainer)."""
    return moe_training_record(cfg, devices, METRICS)


# session scope: kept for the whole run of a worker. A module-scoped record is torn down whenever the
# worker's next test is in another module (xdist interleaves modules; slow tests run first), and building
# it again traces and lowers the program again, even where the compile cache has it.
@pytest.fixture(scope="session")
def one_device_run():
    """(record, trainer) of the single-device reference."""
    return _record(tiny_config(*EP_MOE, "parallel.data=1", "train.micro_batch_size=8"), jax.devices()[:1])


@pytest.fixture(scope="session")
def one_device(one_device_run):
    return one_device_run[0]


# the micro batch is per data-parallel replica (data x fsdp x expert): 8 sequences per micro batch in all
DP4, DP8 = "train.micro_batch_size=2", "train.micro_batch_size=1"
LAYOUTS = {
    # expert weights split over fsdp and tensor as the dense MLP's; sequence parallel: each tensor rank
    # dispatches its own half of the sequence, experts at full width
    "expert2-fsdp2-tensor2-sp": ("parallel.expert=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.data=1",
                                 "parallel.sequence_parallel=true", DP4),
    "expert4-data2": ("parallel.expert=4", "parallel.data=2", DP8),
    # the dispatch's shard_map nested in the 1F1B stages' one
    "expert2-stage2-data2": ("parallel.expert=2", "parallel.stage=2", "parallel.data=2", DP4),
}
# Also passed this test in one-off runs, left out for CI time (about a minute per layout): expert 8 (one local
# expert per rank), expert 2 x fsdp 2 x tensor 2 without sequence parallelism, and expert 2 x context 2 x data 2
# (the sequence split over context inside the dispatch).


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_equals_one_device(one_device, layout):
    """Worst-case capacity (model.moe.ep_capacity_factor unset): nothing dropped, and the run is one device's
    dropless run: losses, gradient norms, every gradient leaf, aux/z losses and load, relative 1e-5."""
    eight, trainer = _record(tiny_config(*EP_MOE, *LAYOUTS[layout]), jax.devices())
    assert_same_training(eight, one_device)
    np.testing.assert_allclose(eight["moe"], one_device["moe"], rtol=1e-5)
    assert [row[-1] for row in eight["moe"]] == [0.0, 0.0, 0.0]  # moe_dropped
    spec = lambda name: tuple(trainer.state["params"]["layers"]["mlp"][name].sharding.spec) + (None,) * 4  # noqa
    assert spec("w_gate")[:2] == ("stage", "expert")     # [layers, experts, embed, mlp]: experts split
    assert spec("router")[2] is None                     # [layers, embed, experts]: router columns replicated
    if layout.startswith("expert2-fsdp2-tensor2"):        # and over fsdp and tensor as the dense MLP
        assert spec("w_down")[:4] == ("stage", "expert", "tensor", ("fsdp", "context"))


def _layer_on(overrides, ep_dispatch="all_to_all"):
    routed_only = [o for o in EP_MOE if "shared" not in o]  # the numpy reference has no shared expert
    cfg = tiny_config(*routed_only, *overrides)
    layout = Layout.build(cfg, jax.devices())
    model = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, ep_dispatch=ep_dispatch))
    with nnx.use_eager_sharding(False):
        layer = MoE(model, rngs=nnx.Rngs(0))
    return layout, layout.place(layer)


def _drop_mask(experts: np.ndarray, rows_per_device: int, seq: int, ranks: int, local: int, cap: int):
    """[T, k] dropped assignments, counted directly: each device's tokens (contiguous batch rows), first
    choices before second ones, in token order, into a queue per destination rank of ``cap`` rows."""
    t, k = experts.shape
    drop = np.zeros((t, k), bool)
    per_device = rows_per_device * seq
    for start in range(0, t, per_device):
        seen = np.zeros(ranks, int)
        for j in range(k):
            for tok in range(start, start + per_device):
                rank = experts[tok, j] // local
                drop[tok, j] = seen[rank] >= cap
                seen[rank] += 1
    return drop


def _ragged_drop_mask(experts: np.ndarray, rows_per_device: int, seq: int, ranks: int, local: int, rows_max: int):
    """[T, k] dropped assignments of ragged_all_to_all, counted directly: each receiver's buffer of
    ``rows_max`` rows takes its senders' rows in sender rank order, each sender's in expert order."""
    t, k = experts.shape
    drop = np.zeros((t, k), bool)
    per_device = rows_per_device * seq
    for group in range(0, t // per_device, ranks):      # the devices that share an expert axis
        for receiver in range(ranks):
            filled = 0
            for sender in range(ranks):
                start = (group + sender) * per_device
                choices = experts[start:start + per_device].reshape(-1)  # token-major
                for i in np.argsort(choices, kind="stable"):
                    if choices[i] // local == receiver:
                        drop[start + i // k, i % k] = filled >= rows_max
                        filled += 1
    return drop


@pytest.mark.parametrize("ep_dispatch", ["all_to_all", "ragged_all_to_all"])
def test_small_capacity_drops_exactly_the_overflow_of_each_rank_buffer(ep_dispatch, monkeypatch):
    """expert 4 x data 2, ep_capacity_factor 0.5: the layer's dropped count equals a direct count, its output
    equals the token-by-token reference without the dropped assignments, and the step exchanges with
    all-to-all. all_to_all drops past each per-rank send buffer; ragged_all_to_all (the collective emulated on
    CPU) past each receive buffer of 4 x that."""
    from jaxtron.parallel import expert

    monkeypatch.setattr(expert, "ragged_all_to_all", _emulated_ragged_all_to_all)
    factor, b, s = 0.5, 8, 16
    layout, layer = _layer_on(("parallel.expert=4", "parallel.data=2", f"model.moe.ep_capacity_factor={factor}"),
                              ep_dispatch)
    x = np.random.default_rng(1).normal(size=(b, s, 64)).astype(np.float32)
    graphdef, state = nnx.split(layer)
    with layout.tracing():
        fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
        xs = jax.device_put(x, layout.sharding(("act_batch", "act_seq", "act_embed")))
        y, stats = fn(state, xs)
        hlo = fn.lower(state, xs).compile().as_text()
    assert "all-to-all" in hlo
    experts, _ = _np_route(x.reshape(-1, 64), np.asarray(layer.router[...]), layer.moe)
    rows = b // 8  # one batch row per device (data 2 x expert 4)
    cap = capacity(rows * s, 2, 4, 2, factor)
    assert cap == 4  # ceil(0.5 * 16 tokens * 2 / 4 ranks)
    if ep_dispatch == "all_to_all":
        drop = _drop_mask(experts, rows, s, 4, 2, cap)
    else:
        drop = _ragged_drop_mask(experts, rows, s, 4, 2, 4 * cap)
    assert 0 < drop.sum() < drop.size
    assert float(stats["dropped"]) == drop.sum()
    ref, _ = _np_moe(layer, x, drop)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-6)


def _output_and_grads(overrides, ep_dispatch="all_to_all"):
    """(jaxpr, output, gradients of sum(y^2)) of one MoE layer on a mesh of ``overrides``; ``ep_dispatch`` is
    given to the layer only (the Layout refuses ragged_all_to_all on CPU)."""
    layout, layer = _layer_on(overrides, ep_dispatch)
    x = np.random.default_rng(1).normal(size=(8, 16, 64)).astype(np.float32)
    graphdef, state = nnx.split(layer)

    def loss(st, x):
        y, _ = nnx.merge(graphdef, st)(x)
        return (y ** 2).sum(), y

    with layout.tracing():
        xs = jax.device_put(x, layout.sharding(("act_batch", "act_seq", "act_embed")))
        jaxpr = str(jax.make_jaxpr(loss)(state, xs))
        (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, xs)
    return jaxpr, np.asarray(y), jax.tree.map(np.asarray, grads)


EP4 = ("parallel.expert=4", "parallel.data=2")


@functools.cache
def _whole_dispatch():
    """_output_and_grads of the plain all_to_all dispatch on expert 4 x data 2: the reference of the dispatch
    variants below."""
    return _output_and_grads(EP4)


def _assert_same_layer(got, expected):
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-7)
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(expected[2]), jax.tree.leaves(got[2])):
        assert np.linalg.norm(a - e) <= 1e-5 * np.linalg.norm(e), jax.tree_util.keystr(path)


def test_pallas_grouped_matmul_runs_on_each_ranks_experts():
    """model.moe.gmm_impl=pallas inside the dispatch (interpreted on CPU) on expert 4 x data 2: the kernel runs
    (gate, up, down) and the layer's output and gradients equal ragged_dot's to 1e-5."""
    got = _output_and_grads((*EP4, "model.moe.gmm_impl=pallas"))
    assert got[0].count("pallas_call") == 3 and "ragged_dot" not in got[0] and "all_to_all" in got[0]
    _assert_same_layer(got, _whole_dispatch())


def test_overlapped_dispatch_equals_the_whole_one():
    """model.moe.ep_overlap on expert 4 x data 2 at worst-case capacity: each device's tokens go in chunks
    pipelined by their data dependencies alone (no barrier); twice the exchanges, the same output and
    gradients as the whole dispatch."""
    from jaxtron.parallel.expert import OVERLAP_CHUNKS

    got, whole = _output_and_grads((*EP4, "model.moe.ep_overlap=true")), _whole_dispatch()
    assert got[0].count("all_to_all") == OVERLAP_CHUNKS * whole[0].count("all_to_all") > 0
    assert "optimization_barrier" not in got[0]
    _assert_same_layer(got, whole)


def test_row_gathers_have_the_values_and_gradients_of_take():
    """gather_rows and combine_rows (the dispatch's permutations, whose gradients are gathers) against jnp.take
    and a weighted sum, out-of-range indices (empty slots, dropped assignments) included: values and every
    gradient equal; and the dispatch's compiled gradient scatters no floats (only the small int inverse
    permutations)."""
    import jax.numpy as jnp

    from jaxtron.parallel.expert import combine_rows, gather_rows, sorted_dropless

    rng = np.random.default_rng(3)
    t, k, slots, d = 6, 2, 15, 4
    x = rng.normal(size=(t, d)).astype(np.float32)
    slot_of = rng.permutation(slots)[:t * k].reshape(t, k).astype(np.int32)
    slot_of[0, 1] = slots                                  # a dropped assignment
    token = np.full(slots, t, np.int32)                    # the token each slot reads, t for an empty slot
    assignment = np.full(slots, t * k, np.int32)
    for i in range(t):
        for j in range(k):
            if slot_of[i, j] < slots:
                token[slot_of[i, j]], assignment[slot_of[i, j]] = i, i * k + j
    w = rng.uniform(size=(t, k)).astype(np.float32)
    take = lambda a, i: jnp.take(a, i, axis=0, mode="fill", fill_value=0)  # noqa: E731

    def ours(x, w):
        rows = gather_rows(x, jnp.asarray(token), jnp.asarray(slot_of)) * 3.0
        return combine_rows(rows, w, jnp.asarray(slot_of), jnp.asarray(assignment))

    def reference(x, w):
        rows = take(x, token) * 3.0
        return jnp.sum(take(rows, slot_of) * w[..., None], axis=1)

    probe = rng.normal(size=(t, d)).astype(np.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * probe)  # noqa: E731
    np.testing.assert_allclose(ours(x, w), reference(x, w), rtol=1e-6)
    for a, b in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(reference), (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    experts = rng.integers(0, 4, size=(t, k)).astype(np.int32)
    ffn = lambda rows, sizes, we: jax.lax.ragged_dot(rows, we, sizes)  # noqa: E731
    f = lambda x, we: jnp.sum(sorted_dropless(x, experts, w, (we,), ffn) ** 2)  # noqa: E731
    hlo = jax.jit(jax.grad(f, (0, 1))).lower(x, rng.normal(size=(4, d, d)).astype(np.float32)).compile().as_text()
    float_scatters = [line for line in hlo.splitlines() if " scatter(" in line and " f32[" in line.split("=")[1]]
    assert not float_scatters, float_scatters


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """jax.lax.ragged_all_to_all's documented semantics from all_gather (XLA:CPU has no ragged all-to-all):
    peer j's rows operand_j[input_offsets_j[me] :][: send_sizes_j[me]] land at output[output_offsets_j[me] :];
    every other output row keeps its value. recv_sizes must be what the peers send: if not, the output is
    poisoned (NaN, or -1 for integers) so that the caller's result is wrong."""
    import jax.numpy as jnp

    me = jax.lax.axis_index(axis_name)
    ops, starts, sizes, dests = (jax.lax.all_gather(a, axis_name) for a in
                                 (operand, input_offsets, send_sizes, output_offsets))
    assert recv_sizes.shape == send_sizes.shape
    r = jnp.arange(operand.shape[0])
    for j in range(ops.shape[0]):
        ok = r < sizes[j, me]
        src = jnp.where(ok, starts[j, me] + r, 0)
        dst = jnp.where(ok, dests[j, me] + r, output.shape[0])  # out of range: not written
        output = output.at[dst].set(jnp.take(ops[j], src, axis=0), mode="drop")
    poison = jnp.nan if jnp.issubdtype(output.dtype, jnp.floating) else -1
    return jnp.where(jnp.any(sizes[:, me] != recv_sizes), poison, output)


def test_ragged_all_to_all_dispatch_equals_the_all_to_all_one(monkeypatch):
    """ep_dispatch=ragged_all_to_all (exact-size exchange) on expert 4 x data 2, with the collective emulated
    from its documented semantics on CPU: through three ragged exchanges (rows, slot ids, results), the layer's
    output and gradients equal the worst-case all_to_all dispatch's (which equals one device) to 1e-5."""
    from jaxtron.parallel import expert

    calls = []

    def emulated(*args, axis_name):
        calls.append(axis_name)
        return _emulated_ragged_all_to_all(*args, axis_name=axis_name)

    monkeypatch.setattr(expert, "ragged_all_to_all", emulated)
    got = _output_and_grads(EP4, "ragged_all_to_all")
    assert len(calls) >= 3 and set(calls) == {("expert",)}
    _assert_same_layer(got, _whole_dispatch())


def test_a_batch_that_does_not_split_runs_the_plain_dispatch():
    """3 sequences (a few prompts in generation) on expert 4 x data 2 cannot split over 8 devices: the plain
    dropless dispatch runs on the split weights instead (no all-to-all) and gives the one-device output."""
    layout, layer = _layer_on(("parallel.expert=4", "parallel.data=2"))
    x = np.random.default_rng(2).normal(size=(3, 16, 64)).astype(np.float32)
    graphdef, state = nnx.split(layer)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[0])
    with layout.tracing():
        y = fn(state, x)
        assert "all-to-all" not in fn.lower(state, x).compile().as_text()
    one = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[0])(jax.device_get(state), x)  # no mesh, no rules
    np.testing.assert_allclose(np.asarray(y), np.asarray(one), rtol=1e-5, atol=1e-7)


def test_capacity_is_at_most_the_worst_case():
    assert capacity(16, 2, 4, 2, None) == 32 == capacity(16, 2, 4, 2, 100.0)   # every choice to one rank
    assert capacity(16, 2, 8, 1, None) == 16                                    # one expert per rank: <= 1 each
    assert capacity(16, 2, 4, 2, 1.0) == 8


@pytest.mark.parametrize("overrides,field", [
    (("model.moe.num_experts=6", "parallel.expert=4", "parallel.data=2"), "parallel.expert"),
    (("model.moe.num_experts=0", "parallel.expert=2", "parallel.data=4"), "parallel.expert"),
    (("parallel.expert=8", "parallel.data=1", "train.global_batch_size=4"), "train.global_batch_size"),
    (("model.moe.ep_dispatch=alltoall",), "model.moe.ep_dispatch"),
    (("model.moe.ep_capacity_factor=0",), "model.moe.ep_capacity_factor"),
    (("parallel.expert=2", "parallel.data=4", "model.moe.ep_dispatch=ragged_all_to_all", "model.moe.ep_overlap=true"),
     "model.moe.ep_overlap"),
])
def test_bad_expert_configs_give_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        preflight.check(tiny_config(*EP_MOE, *overrides))
    assert str(err.value).startswith(f"{field}: ") and len(str(err.value).splitlines()) == 1, str(err.value)


def test_ragged_all_to_all_is_refused_on_cpu():
    cfg = tiny_config(*EP_MOE, "parallel.expert=2", "parallel.data=4", "model.moe.ep_dispatch=ragged_all_to_all")
    with pytest.raises(ConfigError, match=r"^model.moe.ep_dispatch: ragged_all_to_all runs on GPUs only") as err:
        Layout.build(cfg, jax.devices())
    assert len(str(err.value).splitlines()) == 1


def test_without_expert_parallelism_each_device_runs_only_its_own_tokens(one_device_run):
    """parallel.expert=1 on data 8 trains as one device, and each device sends only its own tokens through the
    experts (the dispatch's shard_map), so the step's matmul FLOPs per device are an eighth of one device's
    (GSPMD alone gathered the batch for the dropless sort and ran most of it on every device: 4.9 times the
    eighth). The compiled steps are the equality runs' own (the compile cache has them)."""
    from helpers import synthetic_batch
    from jaxtron.plan import hlo_counts
    from jaxtron.train.trainer import put_batch

    def flops(trainer):
        batch = put_batch(synthetic_batch(trainer.cfg, 0), trainer.batch_sharding)
        return hlo_counts.dot_flops(trainer.train_step.lower(trainer.state, batch).compile().as_text())["total"]

    one, one_trainer = one_device_run
    eight, eight_trainer = _record(tiny_config(*EP_MOE, "parallel.data=8", DP8), jax.devices())
    assert_same_training(eight, one)
    np.testing.assert_allclose(eight["moe"], one["moe"], rtol=1e-5)
    assert flops(eight_trainer) == pytest.approx(flops(one_trainer) / 8, rel=0.02)


def test_start_up_line_says_what_the_exchange_buffers_are():
    """The trainer's one line on the all_to_all buffers (jaxtron.parallel.expert.describe_buffers) for the
    Qwen3-30B-A3B preset on expert 16, 4096 tokens per device: worst case (16x the balanced load, nothing
    dropped) by default, 1.25x and dropping with ep_capacity_factor=1.25; nothing without expert ranks."""
    from jaxtron import config as config_lib
    from jaxtron.parallel.expert import describe_buffers

    from pathlib import Path

    moe = config_lib.load(str(Path(__file__).parents[1] / "configs" / "qwen3_30b_a3b.yaml"), []).model.moe
    line = describe_buffers(moe, 16, 4096)
    assert "32768 rows" in line and "16.00x" in line and "nothing dropped" in line, line
    line = describe_buffers(dataclasses.replace(moe, ep_capacity_factor=1.25), 16, 4096)
    assert "2560 rows" in line and "1.25x" in line and "dropped (moe_dropped)" in line, line
    assert describe_buffers(moe, 1, 4096) is None
