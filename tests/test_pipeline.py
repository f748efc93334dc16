"""Pipeline parallelism (parallel.stage > 1) equals the single-device run, for each schedule and layout.

For every case the fp32 gradient of the whole batch at the initial parameters (leaf by leaf), its norm, and the
losses and gradient norms of 2 optimizer steps with a non-zero learning rate from step 0 equal the
single-device run (plain gradient accumulation over the same micro batches) to 1e-5 relative
(``helpers.assert_same_training``). The 1f1b schedule's compiled temp memory does not grow with the number of
micro batches (GPipe's does) and it runs each stage forward once; a checkpoint saved with 2 stages restores
with 1 and vice versa. With bf16 compute on fp32 master weights, train.cast_params_once (weights cast once per
step, not per tick) trains bit-equal to the per-use casts and leaves no weight cast inside the tick loops. The
CLI (data pipeline, evaluation, logging) trains circular stages with fsdp and tensor like one device.
"""

import logging

import jax
import numpy as np
import pytest

from helpers import (NONZERO_LR, assert_same_training, cpu_xla_flags, synthetic_batch, tiny_config,
                     training_record)
from jaxtron.config import ConfigError
from jaxtron.train.trainer import Trainer, put_batch

STEPS = 2
BATCH = 16

S2_T2_D2 = ("parallel.stage=2", "parallel.tensor=2", "parallel.data=2")
S4_F2 = ("parallel.stage=4", "parallel.fsdp=2", "parallel.data=1")
S2_F2_T2 = ("parallel.stage=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.data=1")
S8 = ("parallel.stage=8", "parallel.data=1")
S2_F2_T2_ONCE = S2_F2_T2 + ("parallel.pipeline_fsdp_gather_once=true",)  # weights gathered once per step
S2_F2_T2_UNROLLED = S2_F2_T2 + ("model.remat=full", "model.scan_unroll=2")  # a stage's 4 layers, 2 per iteration
S2_F2_T2_FULL = S2_F2_T2 + ("model.remat=full",)  # kept residuals are the block inputs; the blocks recompute
S2_T2_D2_RECOMPUTE = S2_T2_D2 + ("parallel.pipeline_recompute=true",)  # the stage forward again in the backward

# (schedule, layout, virtual stages, layers, micro batches)
# Every schedule runs with tensor and with fsdp or data inside the stages; each variant (gather once, remat,
# unrolled scan, recompute) on one layout. circular on fsdp x tensor is also the program whose HLO
# test_fsdp_gather_once_moves_the_weight_all_gathers_out_of_the_tick_loop counts (compiled once through the
# persistent compile cache). zbv: tests/test_zero_bubble_v.py (the same one-device reference).
CASES = [
    ("1f1b", S8, 1, 8, 4), ("1f1b", S2_F2_T2_FULL, 1, 8, 4), ("1f1b", S2_T2_D2_RECOMPUTE, 1, 8, 4),
    ("circular", S2_F2_T2, 2, 8, 4), ("circular", S2_F2_T2_ONCE, 2, 8, 4), ("circular", S4_F2, 2, 8, 4),
    ("gpipe", S2_F2_T2_UNROLLED, 1, 8, 4),   # gpipe is the circular loop with one chunk per stage
    ("zb_h1", S2_T2_D2, 1, 8, 4),   # B and W split, W deferred by the tick table (jaxtron/parallel/zero_bubble.py)
]


def pipe_config(layers: int, micro_batches: int, *overrides: str):
    return tiny_config(f"model.num_layers={layers}", f"train.global_batch_size={BATCH}", *NONZERO_LR, *overrides)


def _dp(overrides) -> int:
    sizes = {"data": 1, "fsdp": 1}
    for o in overrides:
        k, v = o.split("=")
        if k.split(".")[1] in sizes:
            sizes[k.split(".")[1]] = int(v)
    return sizes["data"] * sizes["fsdp"]


_REFERENCES = {}


def reference(layers: int, micro_batches: int):
    key = (layers, micro_batches)
    if key not in _REFERENCES:
        cfg = pipe_config(layers, micro_batches, "parallel.data=1",
                          f"train.micro_batch_size={BATCH // micro_batches}")
        _REFERENCES[key] = training_record(cfg, jax.devices()[:1], steps=STEPS)
    return _REFERENCES[key]


@pytest.mark.parametrize("schedule,layout,virtual,layers,micro_batches", CASES,
                         ids=[f"{c[0]}-" + "-".join(x.split(".")[1].replace("=", "").replace("pipeline_fsdp_gather_oncetrue", "once")
                                                .replace("pipeline_recomputetrue", "recompute")
                                                for x in c[1])
                              + (f"-virtual{c[2]}" if c[2] > 1 else "") for c in CASES])
def test_pipeline_equals_single_device(schedule, layout, virtual, layers, micro_batches):
    cfg = pipe_config(layers, micro_batches, *layout, f"parallel.pipeline_schedule={schedule}",
                      f"parallel.virtual_stages={virtual}",
                      f"train.micro_batch_size={BATCH // (micro_batches * _dp(layout))}")
    assert_same_training(training_record(cfg, jax.devices(), steps=STEPS), reference(layers, micro_batches))


_COMPILED = {}


def compiled_step(schedule: str, micro_batches: int, recompute: bool = False):
    """The train step compiled ahead of time (nothing allocated) on stage 2 of 2 devices, 4 layers of width 64,
    micro batches of 2 x 32 tokens: memoized, so the memory and the FLOP tests share their 1f1b program."""
    from jaxtron.train.program import build_program

    key = (schedule, micro_batches, recompute)
    if key not in _COMPILED:
        cfg = pipe_config(4, micro_batches, "parallel.stage=2", "parallel.data=1", "train.micro_batch_size=2",
                          f"train.global_batch_size={2 * micro_batches}", "model.hidden_size=64",
                          "model.intermediate_size=128", "data.seq_len=32", f"parallel.pipeline_schedule={schedule}",
                          f"parallel.pipeline_recompute={str(recompute).lower()}")
        _COMPILED[key] = build_program(cfg, jax.devices()[:2]).lower_train_step().compile()
    return _COMPILED[key]


def test_1f1b_temp_memory_is_flat_in_micro_batches():
    """The compiled temp memory per device at M = 32 is within 10% of M = 4 for 1f1b (GPipe's grows)."""
    mem = lambda schedule, m: compiled_step(schedule, m).memory_analysis().temp_size_in_bytes  # noqa: E731
    m4, m32 = mem("1f1b", 4), mem("1f1b", 32)
    assert abs(m32 - m4) <= 0.1 * m4, (m4, m32)
    g4, g32 = mem("gpipe", 4), mem("gpipe", 32)
    assert g32 > 1.5 * g4, (g4, g32)  # the check can tell: GPipe keeps every micro batch's stage inputs


def test_checkpoint_moves_between_stage_counts(tmp_path):
    """A state trained 2 steps on stage 2 x fsdp 2 x tensor 2 restores bit-equal on stage 1 (data 2 x fsdp 2 x
    tensor 2) and the next step's loss is the same on both; that step's stage-1 state, saved, restores
    bit-equal on stage 2, and the step after it gives the same loss on both again."""
    from jaxtron.checkpoint import Checkpointer
    layout = lambda s: (f"parallel.stage={s}", "parallel.fsdp=2", "parallel.tensor=2", "parallel.data=-1")
    cfg_a = pipe_config(8, 4, *layout(2), "train.micro_batch_size=2")
    cfg_b = pipe_config(8, 4, *layout(1), "train.micro_batch_size=2")
    run_a, run_b = Trainer(cfg_a, jax.devices()), Trainer(cfg_b, jax.devices())
    batch_a = put_batch(synthetic_batch(cfg_a, 0), run_a.batch_sharding)
    batch_b = put_batch(synthetic_batch(cfg_b, 0), run_b.batch_sharding)
    for _ in range(2):
        run_a.state, _ = run_a.train_step(run_a.state, batch_a)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, keep_every=0, async_save=False)
    ckpt.save(2, run_a.state, {"step": 2})
    ckpt.wait()

    restored, _ = ckpt.restore(2, run_b.spec.abstract_state)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, run_a.state)
    run_b.state = restored
    run_a.state, m_a = run_a.train_step(run_a.state, batch_a)
    run_b.state, m_b = run_b.train_step(run_b.state, batch_b)
    np.testing.assert_allclose(float(m_b["loss"]), float(m_a["loss"]), rtol=1e-5)

    ckpt.save(3, run_b.state, {"step": 3})
    ckpt.wait()
    restored, _ = ckpt.restore(3, run_a.spec.abstract_state)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, run_b.state)
    run_a.state = restored
    run_a.state, m_a = run_a.train_step(run_a.state, batch_a)
    run_b.state, m_b = run_b.train_step(run_b.state, batch_b)
    np.testing.assert_allclose(float(m_a["loss"]), float(m_b["loss"]), rtol=1e-5)


def test_bubble_fraction_in_startup_summary(caplog, monkeypatch):
    cfg = pipe_config(8, 4, *S4_F2, "parallel.pipeline_schedule=circular", "parallel.virtual_stages=2",
                      "train.micro_batch_size=2")
    trainer = Trainer(cfg, jax.devices())
    assert trainer.layout.bubble == pytest.approx(3 / (2 * 4 + 3))
    # an earlier test's run() may have given the jaxtron logger its own stderr handler (propagate off)
    monkeypatch.setattr(logging.getLogger("jaxtron"), "propagate", True)
    with caplog.at_level("INFO", logger="jaxtron"):
        trainer.log_summary()
    assert "pipeline circular: 4 stages x 2 virtual, 4 micro batches, bubble 27.3%" in caplog.text


def test_layers_not_divisible_is_a_config_error():
    with pytest.raises(ConfigError, match="model.num_layers"):
        Trainer(pipe_config(6, 4, *S4_F2, "train.micro_batch_size=2"), jax.devices())


def test_fsdp_gather_once_moves_the_weight_all_gathers_out_of_the_tick_loop():
    """parallel.pipeline_fsdp_gather_once: no all-gather left inside the pipeline's tick loop (there are some
    without it: the FSDP shards of each tick's weights). The step compiled is training_record's (the train step
    that also returns the gradients): with and without gather once, the programs of the two circular
    stage2-fsdp2-tensor2 cases of test_pipeline_equals_single_device, so the suite's persistent compile cache
    compiles each once."""
    import re

    from jaxtron.train.step import make_train_step

    def all_gathers_in_loop(once: str) -> int:
        cfg = pipe_config(8, 4, *S2_F2_T2, "parallel.pipeline_schedule=circular", "parallel.virtual_stages=2",
                          "train.micro_batch_size=2", f"parallel.pipeline_fsdp_gather_once={once}")
        run = Trainer(cfg, jax.devices())
        p = run.program
        step = make_train_step(cfg, p.spec, p.tx, p.schedule, p.layout, return_grads=True)
        batch = put_batch(synthetic_batch(cfg, 0), run.batch_sharding)
        hlo = step.lower(run.state, batch).compile().as_text()
        return sum(1 for line in hlo.splitlines()
                   if re.search(r"= \S+ all-gather\(", line) and "shard_map/while" in line)

    assert all_gathers_in_loop("false") > 0
    assert all_gathers_in_loop("true") == 0


def _cli_metrics(out, devices: int, *overrides: str) -> list[dict]:
    import json
    import os
    import subprocess
    import sys

    # a 1 MB corpus and one held-out batch per evaluation (at step 0 and at the end): the data pipeline and
    # the evaluation run as in a real run, without the default corpus's minutes of tokenizing on a loaded CPU
    cmd = [sys.executable, "-m", "jaxtron.train", "train.steps=2", "train.micro_batch_size=1",
           "checkpoint.enabled=false", "logging.log_every=1", "logging.progress=false", *NONZERO_LR,
           "data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1",
           f"train.output_dir={out}", *overrides]
    env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(devices)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_circular_with_fsdp_and_tensor_trains_like_one_device(tmp_path):
    """The real training loop (data pipeline, evaluation, logging) at the default model size (4 layers: one per
    chunk), the command that used to deadlock XLA:CPU's collectives in step 1: circular schedule with fsdp and
    tensor on 8 devices.
    Losses and gradient norms of 2 steps and the held-out losses before and after them equal the one-device
    run."""
    layout = ("parallel.stage=2", "parallel.pipeline_schedule=circular", "parallel.virtual_stages=2",
              "parallel.fsdp=2", "parallel.tensor=2")
    actual = _cli_metrics(tmp_path / "circular", 8, *layout)
    expected = _cli_metrics(tmp_path / "one", 1)
    for key in ("loss", "grad_norm", "eval_loss"):
        a = [r[key] for r in actual if key in r]
        e = [r[key] for r in expected if key in r]
        assert len(e) == 2, (key, e)  # 2 steps; held out at step 0 and at the end
        np.testing.assert_allclose(a, e, rtol=1e-5, err_msg=key)


def test_1f1b_runs_each_stage_forward_once():
    """The compiled 1f1b step's matmul FLOPs (every dot of the optimized HLO, loops multiplied, each branch of a
    conditional counted) keeping the stage's residuals are 3/4 of those with parallel.pipeline_recompute: per
    tick a forward and a backward (2 forwards' worth) against a forward, its recomputation and the backward.
    The loss head runs the same in both, so the ratio sits a little above 3/4."""
    from jaxtron.plan.hlo_counts import dot_flops

    flops = lambda recompute: dot_flops(compiled_step("1f1b", 4, recompute).as_text())["total"]  # noqa: E731
    ratio = flops(False) / flops(True)
    assert 0.74 < ratio < 0.80, ratio


# bf16 compute on fp32 master weights, stage 2 x fsdp 2 (4 micro batches of 2 rows per FSDP rank); 24 positions,
# so that no activation has a weight's shape (the cast count tells them apart by shape)
BF16_S2_F2 = ("model.dtype=bfloat16", "data.seq_len=24", "parallel.stage=2", "parallel.fsdp=2", "parallel.data=1",
              "train.micro_batch_size=2")
# 1f1b: the bf16 copy gathered once per step; gpipe: casts inside its loop, gathers in each tick (zb_h1 shares
# 1f1b's cast and accumulation: checked bit-equal by hand, left out for CI time)
CAST_CASES = [("1f1b", ("parallel.pipeline_fsdp_gather_once=true",)), ("gpipe", ())]


def _cast_config(schedule: str, once: bool, *overrides: str):
    return pipe_config(4, 4, *BF16_S2_F2, f"parallel.pipeline_schedule={schedule}",
                       f"train.cast_params_once={str(once).lower()}", *overrides)


@pytest.mark.parametrize("schedule,extra", CAST_CASES, ids=[c[0] for c in CAST_CASES])
def test_pipeline_cast_once_trains_as_cast_per_use(schedule, extra):
    """train.cast_params_once in a pipeline: the weights cast once per step (1f1b: before the tick loop and
    before the once-per-step FSDP gather; gpipe: inside its loop, before the ticks) train exactly as the per-use
    casts in every tick: the same bf16 products, each micro batch's bf16 weight gradient converted to fp32
    before the fp32 sum. Bit-equal gradients (every leaf), losses and gradient norms over 2 steps. The loss
    falls: bf16 activations cross the stage boundaries on CPU (XLA:CPU aborted on bf16 stage reductions)."""
    once, per_use = (training_record(_cast_config(schedule, o, *extra), jax.devices()[:4], steps=2)
                     for o in (True, False))
    assert np.all(np.isfinite(once["losses"])) and once["losses"][-1] < once["losses"][0], once["losses"]
    np.testing.assert_array_equal(once["losses"], per_use["losses"])
    np.testing.assert_array_equal(once["grad_norms"], per_use["grad_norms"])
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(per_use["grads"]), jax.tree.leaves(once["grads"])):
        np.testing.assert_array_equal(a, e, err_msg=jax.tree_util.keystr(path))


def _weight_casts_in_tick_loop(schedule: str, once: bool) -> int:
    """fp32 -> bf16 conversions of a stacked weight (a layer's slice or a stage's chunk) inside a loop of the
    pipeline's shard_map in the traced train step (the tick loops, forward and backward): each runs once per
    tick (counted in the jaxpr, nested calls included). The shared leaves (embedding, head) are left out: the
    model's rule may keep them cast per use (a lookup inside a shard_map, a tied or chunked head)."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    cfg = _cast_config(schedule, once)
    run = Trainer(cfg, jax.devices()[:4])
    params = jax.tree.leaves(run.spec.abstract_state["params"])
    layers = cfg.model.num_layers
    stacked = [p for p in params if p.shape[:1] == (layers,)]
    shapes = {tuple(p.shape[1:]) for p in stacked} | {(layers // 2, *p.shape[1:]) for p in stacked}
    batch = put_batch(synthetic_batch(cfg, 0), run.batch_sharding)

    def subs(eqn):
        for v in eqn.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(j, (Jaxpr, ClosedJaxpr)):
                    yield getattr(j, "jaxpr", j)

    def count(jaxpr, in_map: bool, in_loop: bool) -> int:
        n = 0
        made_by = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "convert_element_type" and in_loop:
                aval = eqn.invars[0].aval
                # a weight gradient a backward matmul makes in fp32 and rounds to the bf16 weight's cotangent is
                # the same either way: not a cast of the weight
                n += (aval.dtype == np.float32 and eqn.params["new_dtype"] == jax.numpy.bfloat16
                      and tuple(aval.shape) in shapes and made_by.get(eqn.invars[0]) != "dot_general")
            for sub in subs(eqn):
                n += count(sub, in_map or name == "shard_map", in_loop or (in_map and name == "scan"))
        return n

    return count(run.train_step.trace(run.state, batch).jaxpr.jaxpr, False, False)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_casts_no_weight_inside_the_tick_loop(schedule):
    """Cast per use, every tick converts the stage's weights (in the forward, and again for the backward's
    weight-only residuals); with train.cast_params_once none is converted inside the loops."""
    per_use, once = _weight_casts_in_tick_loop(schedule, False), _weight_casts_in_tick_loop(schedule, True)
    print(f"fp32 -> bf16 weight casts inside the {schedule} loops: per use {per_use}, cast once {once}")
    assert per_use >= 2 * 7, per_use  # wq wk wv wo, gate up down: forward and backward
    assert once == 0, once
