"""The Pallas kernels and the train step that uses them compile with the real XLA:GPU compiler for an H100
(shared-memory and register limits checked), on this CPU-only machine. Needs the ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` of the installed jax version (the ``test`` extra has them for jax 0.10.2)."""

import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import FAST_COMPILE
from helpers import xla_gpu_plugin_version

PLUGIN = xla_gpu_plugin_version()
pytestmark = pytest.mark.skipif(PLUGIN != jax.__version__,
                                reason=f"jax-cuda12-plugin {PLUGIN} does not match jax {jax.__version__}")


def test_kernels_and_train_step_compile_for_h100():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = FAST_COMPILE  # LLVM at -O0 (conftest): whether the kernels compile does not depend on it
    # The script's sys.path starts at tests/: put this checkout first, so that it compiles the kernels under test
    # and not those of wherever the package happens to be installed from.
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, os.path.join(here, "gpu_compile_check.py")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["platform"] == "gpu" and "H100" in out["device_kind"]
    # forward + backward: attention 1 + 2 kernels, rope 2 + 2 (q and k), swiglu 1 + 1
    assert out["flash_attention"]["triton_calls"] == 3
    assert out["flash_attention_causal"]["triton_calls"] == 3
    # The Mosaic kernels are custom calls (Mosaic builds their GPU binaries itself,
    # outside this XLA compile: here XLA places the calls and their buffers, and Mosaic's lowering has already
    # checked shared memory).
    assert out["flash_attention_mosaic"]["mosaic_calls"] == 2            # forward, dk/dv with dq fused in
    assert out["flash_attention_mosaic"]["triton_calls"] == 0
    assert out["flash_attention_mosaic_dq_kernel"]["mosaic_calls"] == 3  # forward, dq, dk/dv
    assert out["flash_attention_mosaic_dq_kernel"]["triton_calls"] == 0
    assert out["rope"]["triton_calls"] == 4
    assert out["swiglu"]["triton_calls"] == 2
    assert out["train_step"]["triton_calls"] == 9  # the model really runs the kernels, per shard
    # grouped matmul: forward gmm; backward gmm with rhs read transposed (d_lhs) and tgmm (d_rhs)
    assert out["gmm"]["triton_calls"] == 3
    # Below one copy of rhs (8 x 1024 x 2048 bf16 = 32 MiB): no transposed or padded weights and no [G, M, N]
    # masked dense product (ragged_dot's XLA:GPU fallback); the 16 MiB is the forward's [M, N] output.
    assert 0 < out["gmm"]["temp_bytes"] < 2**25
    # MoE step, dropless with gmm_impl=pallas: 3 grouped matmuls (gate, up, down) x (forward + 2 backward); with
    # attention_impl=mosaic, its forward and dk/dv (dq fused) kernels (layers scanned: one body)
    assert out["train_step_moe_mosaic"]["triton_calls"] == 9
    assert out["train_step_moe_mosaic"]["mosaic_calls"] == 2
    for name in ("flash_attention", "flash_attention_causal", "flash_attention_mosaic",
                 "flash_attention_mosaic_dq_kernel"):
        assert 0 < out[name]["temp_bytes"] < 2**30  # no [seq, seq] score matrix at seq 8192
