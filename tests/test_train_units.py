"""Optimizer schedules and masks, the loss, the FLOPs formula, metrics rows and log lines."""

import json
import logging
import time

import jax
import jax.numpy as jnp
import pytest

from jaxtron import config as config_lib
from jaxtron.train.flops import device_peak_tflops, flops_per_token
from jaxtron.train.loss import cross_entropy_sums
from jaxtron.train.optimizer import decay_mask, learning_rate_schedule


def optim(**kw):
    return config_lib.OptimConfig(**{"lr": 1.0, "min_lr_ratio": 0.1, "warmup_steps": 10, **kw})


def test_cosine_schedule():
    s = learning_rate_schedule(optim(schedule="cosine"), total_steps=110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-3)  # halfway down the cosine from 1.0 to 0.1
    assert float(s(110)) == pytest.approx(0.1)


def test_linear_schedule():
    s = learning_rate_schedule(optim(schedule="linear"), total_steps=110)
    assert float(s(60)) == pytest.approx(0.55) and float(s(110)) == pytest.approx(0.1)


def test_wsd_schedule():
    s = learning_rate_schedule(optim(schedule="wsd", decay_steps=20), total_steps=110)
    assert float(s(50)) == pytest.approx(1.0) and float(s(90)) == pytest.approx(1.0)
    assert float(s(100)) == pytest.approx(0.55) and float(s(110)) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_and_biases():
    params = {"embed": 1, "final_norm": {"scale": 1},
              "layers": {"attn_norm": {"scale": 1}, "attention": {"wq": 1, "bq": 1}, "mlp": {"w_up": 1}}}
    mask = decay_mask(params)
    assert mask["embed"] and mask["layers"]["attention"]["wq"] and mask["layers"]["mlp"]["w_up"]
    assert not mask["final_norm"]["scale"] and not mask["layers"]["attn_norm"]["scale"]
    assert not mask["layers"]["attention"]["bq"]


def test_cross_entropy_mask_and_z_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    targets = jnp.array([[1, 2, 3, 4, 5], [0, 6, 1, 2, 3]])
    mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
    ce, z, n = cross_entropy_sums(logits, targets, mask, z_loss=1e-2)
    logp = jax.nn.log_softmax(logits)
    expected = -sum(float(logp[b, t, targets[b, t]]) for b in range(2) for t in range(5) if mask[b, t])
    assert float(n) == 8 and float(ce) == pytest.approx(expected, rel=1e-5)
    lse = jax.nn.logsumexp(logits, -1)
    assert float(z) == pytest.approx(1e-2 * float(jnp.sum(lse ** 2 * mask)), rel=1e-5)


def megatron_flops_per_token(m, s, causal):
    """Megatron-LM's num_floating_point_operations for one token (GQA, SwiGLU, no MoE)."""
    h, L = m.hidden_size, m.num_layers
    hd = config_lib.head_dim(m)
    ratio = hd * m.num_heads / h
    attn = (1 + m.num_kv_heads / m.num_heads + (s / h) * (0.5 if causal else 1.0)) * ratio
    return 12 * L * h * h * (attn + m.intermediate_size / h * 1.5 + m.vocab_size / (2 * L * h))


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_70b", "qwen2_7b", "qwen3_8b"])
def test_flops_match_megatron(preset):
    m = config_lib.load(preset).model
    for conv, causal in (("full", False), ("causal", True)):
        assert flops_per_token(m, 8192, conv) == pytest.approx(megatron_flops_per_token(m, 8192, causal), rel=1e-12)


def test_llama3_8b_flops_value():
    # 6 x 8.03e9 params-ish plus attention: Megatron's formula gives ~5.8e10 FLOPs/token at seq 8192 (full)
    m = config_lib.load("llama3_8b").model
    assert flops_per_token(m, 8192, "full") == pytest.approx(5.77e10, rel=0.01)


def test_peak_table():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("cpu") is None


# ------------------------------------------------------------------------------ metrics rows and log lines


def _strict(line):
    def no_constant(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=no_constant)


def test_metrics_rows_are_strict_json_and_a_resume_drops_the_rows_it_redoes(tmp_path):
    from jaxtron.train.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path), 6, tensorboard=False, progress=True)  # not a TTY here: no bar
    assert not w.has_bar
    w.write(0, {"eval_loss": 5.5})
    for step in range(1, 5):
        w.write(step, {"loss": float("nan") if step == 2 else 1.0 / step, "grad_norm": float("inf"),
                       "consumed_samples": 8 * step})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # cut short by a crash
    rows = [_strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert rows[2]["loss"] is None and rows[2]["grad_norm"] is None and rows[1]["loss"] == 1.0
    assert rows[1]["consumed_samples"] == 8 and isinstance(rows[1]["time"], float)
    assert rows[1]["timestamp"].startswith(time.strftime("%Y", time.gmtime()))
    w = MetricsWriter(str(tmp_path), 6, tensorboard=False, progress=False, start_step=2)  # resumed from step 2
    w.write(3, {"loss": 0.5})
    w.close()
    rows = [_strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["loss"] == 0.5
    MetricsWriter(str(tmp_path), 6, tensorboard=False, progress=False, start_step=0).close()  # a fresh start
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_log_line_and_device_memory():
    from jaxtron.train.metrics import device_memory, log_line

    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    assert device_memory([Dev(None)]) == {}  # CPU
    mem = device_memory([Dev({"bytes_in_use": 2 * 2**30, "peak_bytes_in_use": 3 * 2**30}),
                         Dev({"bytes_in_use": 2**30, "peak_bytes_in_use": 4 * 2**30})])
    assert mem == {"memory_gib": 2.0, "memory_peak_gib": 4.0}
    r = {"loss": 2.43125, "grad_norm": 0.8134, "lr": 2.96e-4, "step_time_s": 0.199, "tokens_per_s": 41200.0,
         "tokens_per_s_per_device": 5150.0, "tflops_per_device": 397.0, "mfu": 0.401, "mfu_causal": 0.369,
         "skipped_steps": 0, **mem}
    assert log_line(20, 200, r) == (
        "step 20/200 | loss 2.4312 | grad norm 0.813 | lr 2.960e-04 | 199 ms/step | 41200 tokens/s (5150 per "
        "device) | 397 TFLOP/s per device | MFU 40.1% full attention (36.9% causal) | memory 2.00 GiB (peak 4.00) "
        "| skipped 0")
    cpu = log_line(3, 5, {**r, "loss": None, "mfu": None, "mfu_causal": None, "memory_gib": None})
    assert "loss nan" in cpu and "MFU" not in cpu and "memory" not in cpu


def test_exit_after_fields_are_validated():
    with pytest.raises(config_lib.ConfigError, match="train.exit_after_steps"):
        config_lib.load(None, ["train.exit_after_steps=-1"])
    with pytest.raises(config_lib.ConfigError, match="train.exit_after_minutes: needs checkpoint.enabled"):
        config_lib.load(None, ["train.exit_after_minutes=5", "checkpoint.enabled=false"])
    assert config_lib.load(None, ["train.exit_after_steps=0", "checkpoint.enabled=false"]).train.exit_after_steps == 0


def test_a_resume_that_changes_train_steps_warns(caplog, monkeypatch):
    from jaxtron.train.loop import warn_changed_steps

    cfg = config_lib.load(None, ["train.steps=50"])
    before = config_lib.to_yaml(config_lib.load(None, ["train.steps=30"]))
    logger = logging.getLogger("jaxtron")
    monkeypatch.setattr(logger, "propagate", False)  # as after setup_logging: caplog's handler on it alone
    logger.addHandler(caplog.handler)
    try:
        warn_changed_steps(cfg, {"config": before}, 20)
        warn_changed_steps(cfg, {"config": config_lib.to_yaml(cfg)}, 20)
    finally:
        logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if "train.steps changed" in r.getMessage()]
    assert len(warnings) == 1 and "(30 -> 50)" in warnings[0]


def test_exit_after_steps_and_minutes():
    from jaxtron.train.loop import exit_due

    def due(done, start, began, **train):
        cfg = config_lib.load(None, ["train.steps=10", *(f"train.{k}={v}" for k, v in train.items())])
        return exit_due(cfg, done, start, began)

    now = time.monotonic()
    assert due(5, 2, now) is None and due(5, 2, now, exit_after_steps=0) is None
    assert due(4, 2, now, exit_after_steps=3) is None
    assert due(5, 2, now, exit_after_steps=3) == "train.exit_after_steps=3"
    assert due(10, 2, now, exit_after_steps=3) is None  # the last step ends the run anyway
    assert due(3, 2, now, exit_after_minutes=1) is None
    assert due(3, 2, now - 61, exit_after_minutes=1) == "train.exit_after_minutes=1"
