"""Every preset's real train step lowers on abstract shapes (nothing allocated) on the 8 CPU devices; the tiny
one (the default config) also compiles."""

import glob
import os
import time

import jax
import pytest

from jaxtron import config as config_lib
from jaxtron.train.aot import lower_train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))

# The presets describe GPU clusters; here the same model lowers on 8 CPU devices with the XLA attention.
# The 64-GPU 70B layout keeps its tensor-parallel 8 (and sequence parallelism) and drops FSDP to fit; the 16-GPU
# Mixtral layout takes FSDP over the 8.
CPU_FIT = {"llama3_70b.yaml": ["parallel.fsdp=1", "parallel.tensor=8"],
           "mixtral_8x7b.yaml": ["parallel.fsdp=8"],  # two nodes' FSDP over 16 -> 8
           "deepseek_v3.yaml": ["parallel.fsdp=1", "parallel.expert=2"]}  # 1,024 GPUs -> expert 2 x tensor 2 x stage 2


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_preset_train_step_lowers(path):
    name = os.path.basename(path)
    overrides = ["model.attention_impl=xla"] + CPU_FIT.get(name, [])
    cfg = config_lib.load(path, overrides)
    t0 = time.perf_counter()
    lowered = lower_train_step(cfg, jax.devices())
    seconds = time.perf_counter() - t0
    text = lowered.as_text()
    assert "stablehlo" in text or "func.func" in text
    if name == "llama3_8b.yaml":
        assert seconds < 60, f"llama3_8b lowered in {seconds:.1f} s"
    if name == "tiny.yaml":  # the default config (data parallel over the 8 devices) also compiles
        assert cfg == config_lib.load(None)
        assert lowered.compile().memory_analysis() is not None
