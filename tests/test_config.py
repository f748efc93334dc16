"""Config loading, overrides, presets, and one clear line naming the field for bad values."""

import glob
import os
import subprocess
import sys

import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtron.parallel.layout import Layout
from jaxtron import config as config_lib
from jaxtron import preflight
from jaxtron.train.__main__ import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def test_tiny_yaml_is_the_default():
    assert config_lib.load(os.path.join(REPO, "configs", "tiny.yaml")) == config_lib.load()


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_every_preset_loads_and_validates(path):
    cfg = config_lib.load(path)
    assert isinstance(cfg, config_lib.Config)
    assert cfg.model.num_heads % cfg.model.num_kv_heads == 0
    preflight.check(cfg)  # the model's and the mesh's checks on the sizes the preset fixes


def test_config_is_a_leaf():
    """``jaxtron.config`` imports nothing else of jaxtron (and so no JAX): the checks that need the model or the
    mesh are jaxtron.preflight's."""
    code = ("import sys\n"
            "import jaxtron\n"
            "before = set(sys.modules)\n"
            "import jaxtron.config\n"
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('jaxtron', 'jax', 'jaxlib', "
            "'flax', 'pallas_kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "jaxtron.config.validation" in loaded, loaded
    assert all(m.startswith("jaxtron.config") for m in loaded), loaded


def test_dotted_overrides_and_types():
    cfg = config_lib.load("llama3_8b", ["parallel.tensor=8", "train.steps=100", "model.rope_scaling.type=llama3",
                                         "optim.decay_steps=50"])
    assert cfg.parallel.tensor == 8 and cfg.train.steps == 100 and isinstance(cfg.train.steps, int)
    assert cfg.model.rope_scaling.type == "llama3" and cfg.optim.decay_steps == 50
    assert cfg.model.hidden_size == 4096  # from the preset


def test_config_round_trips_through_dict():
    cfg = config_lib.load("qwen2_7b")
    assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg


HAS_MOSAIC_INTERPRETER = hasattr(plgpu, "InterpretGPUParams")

BAD = [
    (["model.foo=1"], "model.foo"),
    (["trian.steps=1"], "trian"),
    (["train.steps=abc"], "train.steps"),
    (["model.num_kv_heads=3"], "model.num_kv_heads"),
    (["parallel.tensor=3"], "parallel.tensor"),
    (["parallel.data=3", "train.global_batch_size=24"], "parallel"),
    (["parallel.data=1", "train.global_batch_size=10", "train.micro_batch_size=4"], "train.global_batch_size"),
    (["model.attention_impl=flash"], "model.attention_impl"),
    (["parallel.stage=3"], "model.num_layers"),                       # 4 layers in 3 stages
    (["parallel.pipeline_schedule=zb"], "parallel.pipeline_schedule"),
    (["parallel.virtual_stages=2"], "parallel.virtual_stages"),      # needs the circular schedule
    (["parallel.stage=2", "parallel.virtual_stages=4", "parallel.pipeline_schedule=circular"], "model.num_layers"),
    (["parallel.stage=4", "parallel.data=2", "parallel.pipeline_schedule=circular"], "train.micro_batch_size"),
    (["optim.lr=-1"], "optim.lr"),
    (["optim.schedule=step"], "optim.schedule"),
    (["model.remat=some"], "model.remat"),
    (["model.scan_unroll=0"], "model.scan_unroll"),
    (["data.seq_len=0"], "data.seq_len"),
    (["model.attention_impl=cudnn"], "model.attention_impl"),
    (["model.attention_impl=cudnn", "model.deterministic_attention=true"], "model.deterministic_attention"),
    (["model.attention_impl=mosaic", "data.reset_at_eod=false", "model.dtype=float32"], "model.attention_impl"),
    (["model.attention_impl=mosaic", "data.reset_at_eod=false", "model.head_dim=32"], "model.attention_impl"),
    # on CPU: jax 0.10 has no Mosaic GPU interpreter (model.attention_impl); newer JAX resolves dtype=auto to
    # float32 there (model.dtype)
    (["model.attention_impl=mosaic", "data.reset_at_eod=false", "model.hidden_size=256", "model.num_heads=4",
      "model.num_kv_heads=2"], "model.dtype" if HAS_MOSAIC_INTERPRETER else "model.attention_impl"),
    # ... and with bf16, a fused dq whose interpreted partial sums would not fit in memory
    (["model.attention_impl=mosaic", "data.reset_at_eod=false", "model.hidden_size=256", "model.num_heads=4",
      "model.num_kv_heads=2", "model.dtype=bfloat16", "data.seq_len=16384"],
     "model.deterministic_attention" if HAS_MOSAIC_INTERPRETER else "model.attention_impl"),
    (["model.attention_impl=pallas", "model.hidden_size=64", "model.num_heads=8"], "model.attention_impl"),
    (["model.rope_impl=pallas", "model.hidden_size=96", "model.num_heads=4"], "model.rope_impl"),
    (["model.check_kernels=maybe"], "model.check_kernels"),
    (["model.moe.gmm_impl=triton"], "model.moe.gmm_impl"),
    # a valid bf16 mosaic config on the 8 CPU devices tests run with: the interpreter simulates one GPU
    (["model.attention_impl=mosaic", "data.reset_at_eod=false", "model.hidden_size=256", "model.num_heads=4",
      "model.num_kv_heads=2", "model.dtype=bfloat16"], "model.attention_impl"),
    (["parallel.data=2", "parallel.fsdp=-1", "parallel.tensor=-1"], "parallel"),
    (["train.steps"], "train.steps"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_values_give_one_line_naming_the_field(overrides, field, capsys):
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {field}"), err


def test_bad_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: 64\nmodle:\n  x: 1\n")
    assert main(["--config", str(bad)]) == 2
    assert "modle" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_cli_exits_nonzero_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "jaxtron.train", "model.num_kv_heads=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "model.num_kv_heads" in proc.stderr


def test_help_lists_fields_with_docs_and_defaults():
    proc = subprocess.run([sys.executable, "-m", "jaxtron.train", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for name, default, _ in config_lib.fields_help():
        assert name in proc.stdout
    assert "parallel.sequence_parallel" in proc.stdout and "[default: False]" in proc.stdout


@pytest.mark.skipif(not HAS_MOSAIC_INTERPRETER, reason="jax 0.10 has no Mosaic GPU interpreter")
def test_mosaic_on_cpu_refuses_too_few_xla_threads(monkeypatch):
    """Mosaic GPU's interpreter needs an XLA CPU thread per simulated warpgroup plus one; with fewer it hangs
    (seen on a 2-core machine with one CPU device), so both the config and the kernel refuse."""
    from pallas_kernels import mosaic_helpers as fam

    cfg = config_lib.load(None, ["model.attention_impl=mosaic", "data.reset_at_eod=false", "model.hidden_size=256",
                                 "model.num_heads=4", "model.num_kv_heads=2", "model.dtype=bfloat16"])
    preflight.check(cfg, Layout.planned(cfg, 1, "cpu"))                 # 8 CPU devices here: 8 threads
    monkeypatch.setattr(fam, "interpret_threads", lambda: 2)
    with pytest.raises(config_lib.ConfigError, match="model.attention_impl: 'mosaic' on CPU needs 4 XLA CPU"):
        preflight.check(cfg, Layout.planned(cfg, 1, "cpu"))
    with pytest.raises(RuntimeError, match="XLA_FLAGS=--xla_force_host_platform_device_count=4"):
        fam.mosaic_interpret_params()
