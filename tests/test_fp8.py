"""FP8 projections (model.fp8=current): quantize/dequantize and the scaled matmul against numpy (ml_dtypes'
float8 types), gradients against a numpy backward with e5m2 cotangents, training close to the bf16/fp32 run
and equal across layouts (the scales are global amaxes, not per shard), and in the XLA:GPU compile every
projection's forward, dgrad and wgrad GEMM on FP8 operands with the FSDP all-gather at half of bf16's bytes
(current and delayed recipes; the blockwise recipe's GEMMs as Triton calls, against the current one's compile).
Delayed scaling: amax histories that roll, agree across layouts, accumulation and pipeline micro batches, and
resume exactly; routed MoE experts in FP8."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from helpers import NONZERO_LR, assert_same_training, tiny_config, training_record
from jaxtron import config as config_lib
from jaxtron import preflight
from jaxtron.config import ConfigError
from jaxtron.model import fp8
from test_plan import SMALL, _cfg, _cli, needs_xla_gpu, pm

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _np_quantize(x, dtype, fmax):
    scale = np.float32(np.abs(x).max()) / np.float32(fmax)
    q = np.clip(x.astype(np.float32) / scale, -fmax, fmax).astype(dtype)
    return q, scale


@pytest.mark.parametrize("dtype,np_dtype,fmax", [(fp8.E4M3, ml_dtypes.float8_e4m3fn, E4M3_MAX),
                                                (fp8.E5M2, ml_dtypes.float8_e5m2, E5M2_MAX)])
def test_quantize_round_trip_matches_numpy(dtype, np_dtype, fmax):
    rng = np.random.default_rng(0)
    # five decades of magnitude: normals and subnormals of the format after scaling
    x = (rng.standard_normal((64, 48)) * 10.0 ** rng.integers(-3, 2, (64, 48))).astype(np.float32)
    scale = fp8.scale_of(x, dtype)
    q = fp8.quantize(x, dtype, scale)
    q_ref, scale_ref = _np_quantize(x, np_dtype, fmax)
    assert float(scale) == pytest.approx(float(scale_ref), rel=1e-7)
    assert q.dtype == dtype
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))  # bit for bit
    assert float(np.abs(np.asarray(q, np.float32)).max()) == fmax  # the amax lands on the format's max
    back = np.asarray(fp8.dequantize(q, scale, jnp.float32))
    np.testing.assert_array_equal(back, (q_ref.astype(np.float32) * scale_ref).astype(np.float32))
    # e4m3 keeps 3 mantissa bits, e5m2 2: relative error of the round trip on values well above the floor
    big = np.abs(x) > np.abs(x).max() * 1e-2
    rel = np.abs(back[big] - x[big]) / np.abs(x[big])
    assert rel.max() <= (2.0 ** -4 if dtype == fp8.E4M3 else 2.0 ** -3) * 1.001


def test_all_zero_tensor_has_unit_scale():
    assert float(fp8.scale_of(jnp.zeros((4, 4)), fp8.E4M3)) == 1.0


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    w = (rng.standard_normal((32, 24)) * 0.05).astype(np.float32)
    g = rng.standard_normal((2, 8, 24)).astype(np.float32) * 1e-3
    return x, w, g


def test_scaled_matmul_and_its_gradients_match_numpy():
    x, w, g = _inputs()
    spec = "bsd,df->bsf"
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_project(spec, x, w), x, w)
    dx, dw = vjp(g)
    x8, sx = _np_quantize(x, ml_dtypes.float8_e4m3fn, E4M3_MAX)
    w8, sw = _np_quantize(w, ml_dtypes.float8_e4m3fn, E4M3_MAX)
    g8, sg = _np_quantize(g, ml_dtypes.float8_e5m2, E5M2_MAX)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    y_ref = np.einsum(spec, f64(x8), f64(w8)) * (float(sx) * float(sw))
    dx_ref = np.einsum("bsf,df->bsd", f64(g8), f64(w8)) * (float(sg) * float(sw))
    dw_ref = np.einsum("bsd,bsf->df", f64(x8), f64(g8)) * (float(sx) * float(sg))
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    # and it is close to, but not, the full-precision product
    exact = np.einsum(spec, f64(x), f64(w))
    err = np.abs(np.asarray(y, np.float64) - exact).max() / np.abs(exact).max()
    assert 1e-4 < err < 0.1, err  # e4m3's 3 mantissa bits on a 32-long contraction


def test_bf16_operands_give_bf16_results_and_gradients():
    x, w, g = (jnp.asarray(a, jnp.bfloat16) for a in _inputs())
    y, vjp = jax.vjp(lambda x, w: fp8.dense("bsd,df->bsf", x, w, "current"), x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    ref = fp8.dense("bsd,df->bsf", x, w, "none")
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert np.abs(y - ref).max() < 0.1 * np.abs(ref).max()


def test_training_with_fp8_stays_close_to_full_precision():
    base = _train_losses()
    ours = _train_losses("model.fp8=current")
    assert ours != base  # the projections really ran in FP8
    assert abs(ours[-1] - base[-1]) < 0.02 * base[-1], (ours, base)
    assert ours[-1] < ours[0] - 0.2  # and it learns


def _train_losses(*overrides, steps=30):
    from helpers import synthetic_batch
    from jaxtron.train.trainer import Trainer, put_batch

    cfg = tiny_config(*NONZERO_LR, "optim.lr=3e-3", *overrides)
    trainer = Trainer(cfg, jax.devices()[:1])
    batch = put_batch(synthetic_batch(cfg, 0), trainer.batch_sharding)
    return [float(trainer.step(batch)["loss"]) for _ in range(steps)]


def test_fp8_layout_equals_fp8_single_device():
    """data 2 x fsdp 2 x tensor 2: each tensor's scale is its global amax (a sharded weight's max is reduced
    over its shards), so the quantized operands are those of one device and only fp32 sums reorder."""
    cfg = lambda *o: tiny_config(*NONZERO_LR, "model.fp8=current", *o)  # noqa: E731
    one = training_record(cfg("parallel.data=1"), jax.devices()[:1])
    many = training_record(cfg("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"), jax.devices())
    assert_same_training(many, one, rtol=1e-4)


def test_planner_runs_the_fp8_share_at_the_fp8_peak():
    from jaxtron.parallel.layout import Layout
    from jaxtron.plan import get_gpu
    from jaxtron.plan import model as plan_model

    h100, a100 = get_gpu("h100"), get_gpu("a100")
    cfg, cfg8 = _cfg(), _cfg("model.fp8=current")
    layout = Layout.planned(cfg, 8)
    hw = plan_model.hardware_flops_per_device(cfg, layout)
    f8 = plan_model.fp8_flops_per_device(cfg8, layout)
    assert plan_model.fp8_flops_per_device(cfg, layout) == 0 and 0.5 * hw < f8 < hw
    bf16_s = plan_model.compute_seconds(cfg, layout, h100, hw)
    fp8_s = plan_model.compute_seconds(cfg8, layout, h100, hw)
    eff = h100.compute_efficiency * 1e12
    assert fp8_s == pytest.approx(bf16_s - f8 / (h100.peak_tflops * eff) + f8 / (h100.fp8_peak_tflops * eff))
    assert fp8_s < 0.8 * bf16_s
    assert plan_model.compute_seconds(cfg8, layout, a100, hw) == plan_model.compute_seconds(cfg, layout, a100, hw)


def test_unknown_recipe_is_a_config_error():
    with pytest.raises(ConfigError, match="^model.fp8: .*'none'"):
        tiny_config("model.fp8=delayed_maybe")


# ------------------------------------------------------------------------------------ XLA:GPU compile

# hidden 1024: the blockwise recipe's 128 x 128 weight tiles split evenly over the 8 FSDP shards
FSDP8 = ("--gpu", "h100", "--num-gpus", "8", *SMALL, "model.hidden_size=1024", "parallel.data=1", "parallel.fsdp=8",
         "parallel.tensor=1", "model.remat=none")


@needs_xla_gpu
def test_xla_gpu_compile_runs_every_projection_gemm_in_fp8_and_gathers_fp8_weights():
    """8 H100s, FSDP 8, one compile per recipe (all three in one test: the blockwise check compares against the
    current recipe's compile). current and delayed: every projection's forward, dgrad and wgrad dot on FP8
    operands, the weights gathered in e4m3. blockwise: the projections' FP8 dots become 21 Triton calls (7
    projections x forward, dgrad, wgrad; the layer scan's body compiled once), the other dots (attention, LM
    head) are current's, and the FSDP all-gathers move current's FP8 bytes (the tiles' fp32 scales add
    4 / 128^2)."""
    runs = {recipe: _cli(*FSDP8, f"model.fp8={recipe}") for recipe in ("current", "delayed", "blockwise")}
    cfg = _cfg("model.hidden_size=1024")
    m = cfg.model
    d, hd = m.hidden_size, m.hidden_size // m.num_heads
    per_layer = d * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * d * m.intermediate_size
    tokens = cfg.train.global_batch_size * cfg.data.seq_len // 8
    forward = 2.0 * tokens * per_layer  # one layer: the scanned body's dots are counted once
    projections = per_layer * m.num_layers
    rest = pm.param_count(m) - projections
    gathered = lambda r: r["collectives"]["all-gather"]["result_bytes"]  # noqa: E731
    for recipe in ("current", "delayed"):
        r = runs[recipe]
        dots = r["dots"]
        fp8_flops = sum(v["flops"] for k, v in dots.items() if "f8" in k)
        # forward, dgrad and wgrad of every projection: e4m3 x e4m3 forward, e5m2 gradients against e4m3
        assert fp8_flops == pytest.approx(3 * forward, rel=1e-6), (recipe, dots)
        assert {k for k in dots if "f8" in k} >= {"f8e4m3fn x f8e4m3fn", "f8e5m2 x f8e4m3fn"}, (recipe, dots)
        # the planner's closed form counts the same FLOPs (all layers) for the FP8 peak
        assert r["roofline"]["fp8_flops_per_device"] == pytest.approx(fp8_flops * m.num_layers, rel=1e-6), recipe
        # FSDP 8: the projections' weights travel as e4m3 (forward and backward), the rest as bf16
        assert gathered(r) == pytest.approx(2 * projections + 2 * 2 * rest, rel=0.05), recipe
        assert gathered(r) < 0.55 * 2 * 2 * pm.param_count(m), recipe  # about half of the bf16 run's
    cur, blk = runs["current"], runs["blockwise"]
    assert blk["kernels"]["triton_calls"] == 21 and cur["kernels"]["triton_calls"] == 0
    assert not any("f8" in k for k in blk["dots"]), blk["dots"]
    assert blk["dots"] == {k: v for k, v in cur["dots"].items() if "f8" not in k}
    assert gathered(blk) == pytest.approx(gathered(cur), rel=0.02), (gathered(blk), gathered(cur))


# ------------------------------------------------------------------------------------------ delayed scaling

def test_delayed_scaled_matmul_records_amaxes_and_matches_numpy():
    x, w, g = _inputs(1)
    hist = np.zeros((4, 3), np.float32)
    hist[1:3] = [[1.0, 0.08, 2e-3], [1.2, 0.05, 1e-3]]  # x's amax (3.1) exceeds 2^margin x its history
    spec = "bsd,df->bsf"
    y, vjp = jax.vjp(lambda x, w, h: fp8.delayed_project(spec, x, w, h, 1), x, w, jnp.asarray(hist))
    dx, dw, dhist = vjp(g)
    scale = hist.max(0) * 2.0 / np.array([E4M3_MAX, E4M3_MAX, E5M2_MAX], np.float32)

    def q(a, s, dtype, fmax):
        return np.clip(a / s, -fmax, fmax).astype(dtype).astype(np.float64)

    x8, w8 = q(x, scale[0], ml_dtypes.float8_e4m3fn, E4M3_MAX), q(w, scale[1], ml_dtypes.float8_e4m3fn, E4M3_MAX)
    g8 = q(g, scale[2], ml_dtypes.float8_e5m2, E5M2_MAX)
    assert np.abs(x).max() > 2 * 1.2 and np.abs(x8).max() == E4M3_MAX
    for got, ref in ((y, np.einsum(spec, x8, w8) * scale[0] * scale[1]),
                     (dx, np.einsum("bsf,df->bsd", g8, w8) * scale[2] * scale[1]),
                     (dw, np.einsum("bsd,bsf->df", x8, g8) * scale[0] * scale[2])):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(dhist)[1:], 0)
    np.testing.assert_allclose(np.asarray(dhist)[0], [np.abs(x).max(), np.abs(w).max(), np.abs(g).max()], rtol=1e-7)


def test_empty_history_scales_by_one():
    x, w, _ = _inputs(2)
    y = fp8.delayed_project("bsd,df->bsf", x, w, jnp.zeros((2, 3)), 0)
    ref = np.einsum("bsd,df->bsf", np.asarray(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float64),
                    np.asarray(w).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-7)


def test_histories_are_found_by_variable_type():
    """The train step tells amax histories from weights by their variable type (fp8.Histories, read once off
    the abstract model): a weight named like a history is a weight; a history accumulates over micro batches by
    max, gets no optimizer update, rolls in the step's amaxes, and a weights-only load leaves it fresh."""
    from flax import nnx

    class Projection(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2, 2)))
            self.w_amax = fp8.AmaxHistory(jnp.zeros((3, 3)))
            self.v_amax = nnx.Param(jnp.ones((3, 3)))  # a weight, whatever its name says

    h = fp8.Histories.of(nnx.split(nnx.eval_shape(Projection))[1])
    assert h.mask == {"w": False, "w_amax": True, "v_amax": False}
    a = {"w": jnp.full((2, 2), 1.0), "w_amax": jnp.array([[1.0, 5.0, 2.0]] * 3), "v_amax": jnp.full((3, 3), 1.0)}
    b = {"w": jnp.full((2, 2), 2.0), "w_amax": jnp.array([[3.0, 4.0, 2.0]] * 3), "v_amax": jnp.full((3, 3), 2.0)}
    acc = h.accumulate(a, b)
    np.testing.assert_array_equal(acc["w"], 3.0)
    np.testing.assert_array_equal(acc["v_amax"], 3.0)
    np.testing.assert_array_equal(acc["w_amax"][0], [3.0, 5.0, 2.0])
    bare = h.without(b)
    assert float(jnp.abs(bare["w_amax"]).max()) == 0.0 and float(bare["v_amax"].min()) == 2.0
    old = {**a, "w_amax": jnp.arange(9.0).reshape(3, 3)}
    rolled = h.roll(b, old, {**b, "w_amax": jnp.full((3, 3), 7.0)})
    np.testing.assert_array_equal(rolled["w_amax"], [[7.0, 7.0, 7.0], [0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    assert rolled["w"] is b["w"] and rolled["v_amax"] is b["v_amax"]
    assert set(h.weights_only(a)) == {"w", "v_amax"}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in a.items()}
    fresh = h.with_fresh(h.weights_only(a), abstract)
    assert set(fresh) == set(a) and float(jnp.abs(fresh["w_amax"]).max()) == 0.0 and fresh["w"] is a["w"]


def test_start_up_log_names_the_recipe_and_says_it_is_emulated_on_cpu(caplog, monkeypatch):
    import logging

    from jaxtron.train.trainer import Trainer

    trainer = Trainer(_delayed(), jax.devices()[:1])
    monkeypatch.setattr(logging.getLogger("jaxtron"), "propagate", True)  # run() may have set its own handler
    with caplog.at_level("INFO", logger="jaxtron"):
        trainer.log_summary()
    assert ("FP8 matmuls: model.fp8=delayed (tensorwise delayed scaling, 3-step amax history, margin 0); "
            "emulated on CPU") in caplog.text


def _histories(state):
    from jaxtron.model.fp8 import HISTORY_SUFFIX

    flat = jax.tree_util.tree_leaves_with_path(jax.device_get(state["params"]))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat if jax.tree_util.keystr(p).endswith(
        HISTORY_SUFFIX + "']")}


def _delayed(*overrides):
    return tiny_config(*NONZERO_LR, "model.fp8=delayed", "model.fp8_amax_history=3", *overrides)


# 8 devices, 2 accumulation micro batches of one row per data-parallel replica (the resume test's layout too:
# one compiled program for both tests)
DELAYED_8 = ("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "train.micro_batch_size=1")


def test_delayed_histories_roll_and_layouts_and_accumulation_agree():
    """Per step each history shifts by one with the new amaxes in front; data 2 x fsdp 2 x tensor 2 with two
    accumulation micro batches (the amaxes a max over shards and over micro batches), and 2 pipeline stages x
    fsdp 2 under 1f1b (4 micro batches, whose loop keeps the max of their amaxes) record the same global amaxes
    (a max, not a sum) and train the same as one device:
    equal up to FP8 rounding flips, not to fp32's 1e-5: another layout reassociates fp32 sums (one device vs
    data2 x fsdp2 x tensor2: the first RMSNorm's output differs in 2,538 of 8,192 elements, by <= 4.8e-7), and
    an input within that of an e4m3/e5m2 rounding midpoint moves by a whole FP8 step. Measured on one device:
    the embedding table and norm scales times 1 + r * 2^-23 (r in {-1, 0, 1}, numpy default_rng seeds 0-11;
    the quantized matmuls' inputs move by an ulp, their weights not), 3 steps against the unperturbed run:
    10 seeds moved the losses by <= 9e-8, 2 flipped one rounding: losses 1.4e-6, 4.5e-5, 7.6e-5 (the profile
    a layout with that flip shows: 1.4e-6, 4.4e-5, 7.4e-5 was seen), step-1 amaxes up to 8.3e-3 (seed 6). The
    tolerances allow about four flips; amaxes summed over shards instead of maxed are off by tens of percent
    (model.fp8_margin=1, every scale doubled, moves the losses by only 2.7e-5: the amaxes tell a wrong scale)."""
    from helpers import synthetic_batch
    from jaxtron.train.trainer import Trainer, put_batch
    loss_rtol, amax_rtol = 3e-4, 4e-2

    def run(cfg, devices, steps=3):
        trainer = Trainer(cfg, devices)
        batch = put_batch(synthetic_batch(cfg, 0), trainer.batch_sharding)
        out = [(float(trainer.step(batch)["loss"]), _histories(trainer.state)) for _ in range(steps)]
        return [o[0] for o in out], [o[1] for o in out]

    losses, hists = run(_delayed("parallel.data=1"), jax.devices()[:1])
    assert len(hists[0]) == 7  # wq, wk, wv, wo, w_gate, w_up, w_down, each stacked over the 2 layers
    for name, h in hists[-1].items():
        assert h.shape == (2, 3, 3) and np.all(h > 0), name
        np.testing.assert_array_equal(h[:, 1:], hists[-2][name][:, :-1])  # rolled by one step
        np.testing.assert_array_equal(hists[0][name][:, 1:], 0)
    for layout, overrides, devices in (
            ("data2-fsdp2-tensor2-accumulation2", DELAYED_8, jax.devices()),
            ("stage2-fsdp2-1f1b", ("parallel.data=1", "parallel.stage=2", "parallel.fsdp=2",
                                   "train.micro_batch_size=2"), jax.devices()[:4])):
        other_losses, other = run(_delayed(*overrides), devices)
        np.testing.assert_allclose(other_losses, losses, rtol=loss_rtol, err_msg=f"{layout}: losses")
        for name in hists[0]:  # the amaxes step 1 recorded (row 0; the rest is the empty history)
            np.testing.assert_allclose(other[0][name], hists[0][name], rtol=amax_rtol, err_msg=f"{layout}: {name}")


def test_delayed_scaling_resumes_exactly_and_on_another_mesh(tmp_path):
    """Checkpoint after 2 steps on data 2 x fsdp 2 x tensor 2 with 2 accumulation micro batches, restore on the
    same layout and on fsdp 8: the histories come back bit for bit, the same layout continues with
    bit-identical losses and histories, fsdp 8 with equal ones."""
    from helpers import synthetic_batch
    from jaxtron.checkpoint import Checkpointer
    from jaxtron.train.trainer import Trainer, put_batch

    def steps(trainer, cfg, seeds):
        return [float(trainer.step(put_batch(synthetic_batch(cfg, s), trainer.batch_sharding))["loss"])
                for s in seeds]

    cfg = _delayed(*DELAYED_8)
    run = Trainer(cfg, jax.devices())
    steps(run, cfg, [0, 1])
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(2, run.state, {})
    ckpt.wait()
    saved = _histories(run.state)
    continued = steps(run, cfg, [2, 3])
    final = _histories(run.state)
    for other, devices, exact in ((cfg, jax.devices(), True),
                                  (_delayed("parallel.data=1", "parallel.fsdp=8"), jax.devices(), False)):
        resumed = Trainer(other, devices)
        resumed.state, _ = ckpt.restore(2, resumed.spec.abstract_state)
        for name, h in _histories(resumed.state).items():
            np.testing.assert_array_equal(h, saved[name])
        again = steps(resumed, other, [2, 3])
        if exact:
            assert again == continued
            for name, h in _histories(resumed.state).items():
                np.testing.assert_array_equal(h, final[name])
        else:
            np.testing.assert_allclose(again, continued, rtol=1e-5)
    ckpt.close()


@pytest.mark.parametrize("overrides,field", [
    (("model.fp8=delayed", "parallel.stage=2", "parallel.pipeline_schedule=gpipe"), "model.fp8"),
    (("model.fp8=delayed", "model.fp8_amax_history=0"), "model.fp8_amax_history"),
    (("model.fp8=delayed", "model.fp8_margin=-1"), "model.fp8_margin"),
])
def test_delayed_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        preflight.check(tiny_config(*overrides))


def test_weights_only_load_into_delayed_starts_empty_histories(tmp_path):
    """Fine-tuning a bf16/fp32-trained checkpoint with model.fp8=delayed: the weights load, the histories
    (which that checkpoint does not have) start empty, and training runs."""
    from jaxtron.checkpoint import Checkpointer
    from jaxtron.train.trainer import Trainer

    small = ("data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1",
             "train.steps=2", "train.eval_every=0", "parallel.data=1")
    plain = Trainer(tiny_config(*small), jax.devices()[:1])
    ckpt = Checkpointer(str(tmp_path / "plain"))
    ckpt.save(0, plain.state, {})
    ckpt.close()
    tuned = Trainer(_delayed(*small, f"checkpoint.load_weights={tmp_path}/plain",
                             f"train.output_dir={tmp_path}/tuned"), jax.devices()[:1])
    result = tuned.train()
    assert result.final_step == 2 and all(np.isfinite(loss) for _, loss in result.losses)
    hists = _histories(tuned.state)
    assert len(hists) == 7 and all(np.all(h[:, :2] > 0) and np.all(h[:, 2] == 0) for h in hists.values())


def test_bench_kernels_times_the_fp8_gemms():
    """scripts/bench_kernels.py --fp8's cases (GPU-only from the command line) on a small shape here: every
    recipe, forward and backward, timed."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from bench_kernels import fp8_cases

    rows = fp8_cases(16, 1, shapes=(("small", 32, 16),))
    impls = ("bf16", "fp8 current", "fp8 delayed", "fp8 blockwise")
    assert [(r["impl"], r["mode"]) for r in rows] == [(i, m) for i in impls for m in ("fwd", "fwd+bwd")]
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)


@pytest.mark.slow
@needs_xla_gpu
def test_xla_gpu_llama3_8b_runs_every_projection_in_fp8():
    """Llama-3-8B on 8 H100 (FSDP 8, micro batch 1 x 8192): the dgrad and the wgrad dots on FP8 operands have
    exactly twice the projections' FLOPs for one layer's micro batch (the scanned body, counted once), the
    forward ones at least once (remat=full recomputes all but the down projection), and the only bf16 dots
    left are the LM head's, forward and backward (the fp32 logits' cotangent is rounded to bf16: no fp32
    GEMM)."""
    r = _cli("--config", "llama3_8b", "--gpu", "h100", "--num-gpus", "8", "parallel.data=1", "parallel.fsdp=8",
             "parallel.tensor=1", "train.micro_batch_size=1", "model.fp8=current", timeout=900)
    m = config_lib.load("llama3_8b", []).model
    d, hd, tokens = m.hidden_size, m.hidden_size // m.num_heads, 8192
    forward = 2.0 * tokens * (d * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * d * m.intermediate_size)
    dots = r["dots"]
    # dgrad and wgrad: XLA merges the dots sharing an operand, Q/K/V's wgrads on their one e4m3 x into one dot
    # that it writes with the gradient first, so the two mixed orders split the backward's FLOPs unevenly
    mixed = dots["f8e5m2 x f8e4m3fn"]["flops"] + dots["f8e4m3fn x f8e5m2"]["flops"]
    assert mixed == pytest.approx(2 * forward, rel=1e-9), dots
    assert dots["f8e5m2 x f8e4m3fn"]["flops"] >= forward  # every dgrad
    assert dots["f8e4m3fn x f8e4m3fn"]["flops"] >= forward
    assert dots["bf16 x bf16"]["flops"] == pytest.approx(3 * 2.0 * tokens * d * m.vocab_size, rel=1e-9), dots
    assert not any("f32 x" in k or "x f32" in k for k in dots), dots


# ---------------------------------------------------------------------------------- routed MoE experts

def test_fp8_grouped_matmul_and_its_gradients_match_numpy():
    """The routed experts' ragged dot in FP8 (ragged_dot on e4m3, dgrad and wgrad on e5m2 gradients), with an
    empty group and rows past the groups, against numpy float64 on the same quantized values."""
    rng = np.random.default_rng(3)
    sizes = np.array([5, 0, 7], np.int32)  # 12 of 14 rows in groups; the last two come out as zeros
    x = rng.standard_normal((14, 16)).astype(np.float32)
    w = (rng.standard_normal((3, 16, 8)) * 0.2).astype(np.float32)
    g = rng.standard_normal((14, 8)).astype(np.float32) * 1e-2
    y, vjp = jax.vjp(lambda x, w: fp8.grouped(x, w, jnp.asarray(sizes)), x, w)
    dx, dw = vjp(g)[:2]
    x8, sx = _np_quantize(x, ml_dtypes.float8_e4m3fn, E4M3_MAX)
    w8, sw = _np_quantize(w, ml_dtypes.float8_e4m3fn, E4M3_MAX)
    g8, sg = _np_quantize(g, ml_dtypes.float8_e5m2, E5M2_MAX)
    x8, w8, g8 = (a.astype(np.float64) for a in (x8, w8, g8))
    y_ref, dx_ref, dw_ref = np.zeros((14, 8)), np.zeros((14, 16)), np.zeros((3, 16, 8))
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        y_ref[rows] = x8[rows] @ w8[e] * sx * sw
        dx_ref[rows] = g8[rows] @ w8[e].T * sg * sw
        dw_ref[e] = x8[rows].T @ g8[rows] * sx * sg
        start += n
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    assert not np.any(np.asarray(y)[12:]) and not np.any(np.asarray(dw)[1])


def test_fp8_moe_trains_close_to_full_precision():
    """tiny_moe's shape (8 experts, top-2) with the routed experts, shared experts and projections in FP8."""
    moe = ("model.moe.num_experts=8", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32")
    base = _train_losses(*moe)
    ours = _train_losses(*moe, "model.fp8=current")
    assert ours != base and abs(ours[-1] - base[-1]) < 0.02 * base[-1], (ours, base)


@needs_xla_gpu
def test_xla_gpu_routed_experts_run_in_fp8():
    """The MoE test config (4 experts, top-2, data 2 x fsdp 2 x tensor 2), its dense first layer left out (one
    layer body to compile: 2 MoE layers), compiled for 8 H100s with model.fp8=current and gmm_impl=ragged_dot
    (auto takes the Pallas kernel, which has no FP8): every dot under the routed experts' scope has FP8 operands
    (forward, dgrad and wgrad of ragged_dot's lowering)."""
    from test_plan import MOE, MOE_LAYOUT

    r = _cli("--gpu", "h100", "--num-gpus", "8", *MOE, "model.num_layers=2", "model.moe.first_dense_layers=0",
             *MOE_LAYOUT, "model.fp8=current", "model.moe.gmm_impl=ragged_dot")
    experts = r["dots_moe_experts"]
    assert experts and all("f8" in k for k in experts), experts
    assert {"f8e4m3fn x f8e4m3fn", "f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2"} <= set(experts), experts
