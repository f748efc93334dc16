"""Optimizer schedules and masks, the loss, and the FLOPs formula."""

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


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_70b", "qwen2_7b"])
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
