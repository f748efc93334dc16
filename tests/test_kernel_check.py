"""The trainer's start-up check of selected Pallas kernels against XLA (jaxtron/model/kernel_check.py).

On CPU the kernels run interpreted, so the passing case is the real check on real kernels; the failing cases
swap a broken implementation in for 'pallas' attention."""

import jax
import jax.numpy as jnp
import pytest

from jaxtron.model import attention as attention_lib
from jaxtron.model import kernel_check
from jaxtron.train.__main__ import main
from jaxtron.model.kernel_check import KernelCheckError, check_kernels, needs_check
from tests.helpers import tiny_config

ALL_PALLAS = ("model.attention_impl=pallas", "model.rope_impl=pallas", "model.mlp_impl=pallas")
MOE_PALLAS = ("model.moe.num_experts=4", "model.moe.expert_intermediate_size=32", "model.moe.gmm_impl=pallas")


def config(*overrides):
    """head_dim 64 (the kernels need a power of two), 2 query heads per KV head."""
    return tiny_config("model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2", *overrides)


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 1e-2), ("float32", 1e-5)])
def test_pallas_kernels_pass(dtype, bound):
    rows = check_kernels(config(*ALL_PALLAS, *MOE_PALLAS), seq=128, dtype=dtype)
    assert [r["case"] for r in rows] == ["attention causal", "attention packed documents", "rope", "swiglu",
                                         "grouped matmul"]
    for r in rows:
        assert set(r["errors"]) == ({"out", "d0", "d1", "d2"} if r["case"].startswith("attention")
                                    else {"out", "d0", "d1"})
        assert max(r["errors"].values()) < bound, r


def _scaled_wrong(q, k, v, segment_ids, scale, **kw):       # a kernel whose softmax scale is off by 30%
    return attention_lib.xla_attention(q, k, v, segment_ids, scale * 1.3)


def _nan_grad(q, k, v, segment_ids, scale, **kw):            # right output, NaN gradients
    @jax.custom_vjp
    def f(q, k, v):
        return attention_lib.xla_attention(q, k, v, segment_ids, scale)
    f.defvjp(lambda q, k, v: (f(q, k, v), None),
             lambda _, g: tuple(jnp.full_like(x, jnp.nan) for x in (q, k, v)))
    return f(q, k, v)


def _raises(q, k, v, segment_ids, scale, **kw):
    raise RuntimeError("Mosaic GPU: kernel launch failed")


@pytest.mark.parametrize("broken,expect", [
    (_scaled_wrong, "disagrees with the XLA reference"),
    (_nan_grad, "d0 inf"),
    (_raises, "RuntimeError: Mosaic GPU: kernel launch failed"),
])
def test_a_broken_attention_kernel_is_refused(monkeypatch, broken, expect):
    monkeypatch.setitem(attention_lib.IMPLEMENTATIONS, "pallas", broken)
    with pytest.raises(KernelCheckError) as err:
        check_kernels(config("model.attention_impl=pallas"), seq=64, dtype="float32")
    assert err.value.field == "model.attention_impl"
    assert str(err.value).startswith("model.attention_impl: 'pallas': the attention causal kernel")
    assert expect in str(err.value)


def test_a_broken_grouped_matmul_is_refused(monkeypatch):
    from jaxtron.model import kernels

    wrong = lambda x, w, sizes: 1.1 * jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    monkeypatch.setattr(kernels, "gmm", wrong)
    with pytest.raises(KernelCheckError) as err:
        check_kernels(config(*MOE_PALLAS), seq=64, dtype="float32")
    assert err.value.field == "model.moe.gmm_impl"
    assert str(err.value).startswith("model.moe.gmm_impl: 'pallas': the grouped matmul kernel disagrees")
    assert "Use model.moe.gmm_impl=ragged_dot," in str(err.value)


def test_when_the_trainer_checks():
    assert needs_check(config("model.attention_impl=mosaic", "model.dtype=bfloat16"), "gpu")
    assert needs_check(config("model.mlp_impl=pallas"), "cuda")
    assert needs_check(config(*MOE_PALLAS), "gpu")
    assert needs_check(config(*MOE_PALLAS[:2]), "gpu")                        # auto: pallas on GPUs
    assert not needs_check(config(*MOE_PALLAS[:2], "model.moe.gmm_impl=ragged_dot"), "gpu")  # XLA's op
    assert not needs_check(config(*MOE_PALLAS[:2]), "cpu")
    assert not needs_check(config("model.attention_impl=pallas"), "cpu")     # interpreted: exact
    assert not needs_check(config("model.attention_impl=cudnn"), "gpu")      # no Pallas kernel
    assert not needs_check(config("model.attention_impl=pallas", "model.check_kernels=false"), "gpu")


def test_train_stops_with_one_error_line(monkeypatch, tmp_path, capsys):
    """`python -m jaxtron.train` with a kernel that fails its check: exit 2 and one line naming the field,
    before the train step is compiled or a checkpoint written."""
    monkeypatch.setattr(kernel_check, "needs_check", lambda cfg, platform: True)   # as on a GPU
    monkeypatch.setitem(attention_lib.IMPLEMENTATIONS, "pallas", _scaled_wrong)
    out = tmp_path / "run"
    overrides = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1",
                 "model.intermediate_size=128", "data.seq_len=64", "train.steps=2", "logging.progress=false",
                 "model.attention_impl=pallas", f"train.output_dir={out}"]
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("error: model.attention_impl: 'pallas': the attention causal kernel "
                                           "disagrees") and "Traceback" not in err, err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
