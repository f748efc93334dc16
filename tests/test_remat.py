"""model.remat's named policies: each keeps (or offloads to host) the activations it names, and none changes the
numbers: per-leaf gradients equal the default policy's."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import synthetic_batch, tiny_config
from jaxtron.config import REMAT_POLICIES
from jaxtron.model import remat
from jaxtron.train.state import model_factory
from jaxtron.train.trainer import Trainer, put_batch

MOE = ("model.moe.num_experts=4", "model.moe.num_experts_per_token=2", "model.moe.expert_intermediate_size=32")


def test_config_names_every_policy():
    assert REMAT_POLICIES == ("none", *remat.POLICIES)


def _residuals(policy: str, *overrides: str) -> list[str]:
    """jax.ad_checkpoint.print_saved_residuals of the tiny model's forward: one line per residual."""
    cfg = tiny_config(f"model.remat={policy}", *overrides)
    graphdef, params = nnx.split(model_factory(cfg)())
    batch = synthetic_batch(cfg, 0)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(batch["inputs"], batch["positions"], None))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    return out.getvalue().splitlines()


def _scan_outputs(lines):
    """The shapes of the residuals the scanned blocks save ([layers, batch, seq, ...] stacked), and where."""
    return sorted(re.match(r"(\S+)", line).group(1) for line in lines if "output of scan" in line)


def test_named_policies_save_what_they_name():
    # tiny model: 2 layers, batch 8, seq 16, 8 query heads and 4 KV heads of 8, hidden 64
    full = _scan_outputs(_residuals("full"))
    qkv = ["f32[2,8,16,4,8]", "f32[2,8,16,4,8]", "f32[2,8,16,8,8]"]
    assert _scan_outputs(_residuals("save_qkv_proj")) == sorted(full + qkv)
    assert _scan_outputs(_residuals("save_qkv_attention")) == sorted(full + qkv + ["f32[2,8,16,8,8]"])
    offloaded = _scan_outputs(_residuals("offload_qkv_attention"))
    assert sorted(s for s in offloaded if "<host>" in s) == sorted(
        s.replace("f32", "f32<host>") for s in qkv + ["f32[2,8,16,8,8]"])
    assert sorted(s for s in offloaded if "<host>" not in s) == full
    # none saves everything the backward reads; every named policy saves less
    assert len(_residuals("none")) > len(_residuals("save_named")) > len(full)


def test_router_is_saved_by_name():
    full = _scan_outputs(_residuals("full", *MOE))
    mlp = _scan_outputs(_residuals("save_mlp_io", *MOE))
    extra = list(mlp)
    for s in full:
        extra.remove(s)
    # the routing (T = 8 * 16 tokens, k = 2 of 4 experts) and the MLP's input and output [batch, seq, hidden]
    assert {"i32[2,128,2]", "f32[2,128,2]", "f32[2,8,16,64]"} <= set(extra)


def _gradients(policy: str, *overrides: str):
    cfg = tiny_config(f"model.remat={policy}", "parallel.data=1", *overrides)
    trainer = Trainer(cfg, jax.devices()[:1])
    grads, _ = trainer.gradients(put_batch(synthetic_batch(cfg, 0), trainer.batch_sharding))
    return jax.tree.map(lambda g: np.asarray(g, np.float64), grads)


@pytest.fixture(scope="module")
def reference():
    return {"dense": _gradients("none"), "moe": _gradients("none", *MOE)}


# A name is an identity the policies read, so save_named and offload_named (every name, saved or offloaded)
# cover the rest; the MoE model adds the router's name.
@pytest.mark.parametrize("policy", ["save_qkv_attention", "save_named", "offload_named", "moe:save_mlp_io"])
def test_named_policies_do_not_change_the_gradients(reference, policy):
    model, _, policy = policy.rpartition(":")
    expected = reference[model or "dense"]
    got = _gradients(policy, *(MOE if model else ()))
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got)):
        err = np.linalg.norm(a - e) / np.linalg.norm(e)
        assert err <= 1e-6, f"{jax.tree_util.keystr(path)}: relative gradient difference {err:.1e}"


def test_save_dots_attention_keeps_what_the_flash_kernels_backward_reads():
    """A flash kernel's forward is a custom call, not a dot: under save_dots the backward runs it again, for its
    softmax statistics. save_dots_attention keeps what the kernel's backward reads (q after RoPE, k, v, the
    output, the log-sum-exp [layers, batch, heads, seq]) and the attention context that wo's weight gradient
    reads; the gradients are the kernel's own, bit for bit. (That the compiled step then calls the forward
    kernel once: tests/test_plan_steptime.py, on XLA:GPU.)"""
    flash = ("model.attention_impl=pallas", "model.hidden_size=128")  # head_dim 16 for the kernel
    extra = _scan_outputs(_residuals("save_dots_attention", *flash))
    for shape in _scan_outputs(_residuals("save_dots", *flash)):
        extra.remove(shape)
    q, kv, lse = "f32[2,8,16,8,16]", "f32[2,8,16,4,16]", "f32[2,8,8,16]"
    assert extra == sorted([q, q, q, kv, kv, lse])  # q, the output and the context; k, v; the lse
    dots, kept = (_gradients(policy, *flash) for policy in ("save_dots", "save_dots_attention"))
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(dots), jax.tree.leaves(kept)):
        np.testing.assert_array_equal(a, e, err_msg=jax.tree_util.keystr(path))
