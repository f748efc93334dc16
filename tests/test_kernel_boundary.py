"""The kernel boundary: ``jaxtron/model/kernels.py`` is the only jaxtron module that imports ``pallas_kernels``,
and ``pallas_kernels`` loads its Mosaic GPU modules only when the Mosaic backend is asked for."""

import ast
import pathlib
import subprocess
import sys

import pytest

from jaxtron import config as config_lib
from jaxtron.model import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports_pallas_kernels(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "pallas_kernels" or n.startswith("pallas_kernels.") for n in names):
            return True
    return False


def test_only_model_kernels_imports_pallas_kernels():
    importers = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxtron").rglob("*.py")
                       if _imports_pallas_kernels(p))
    assert importers == ["jaxtron/model/kernels.py"]


def test_triton_path_does_not_load_the_mosaic_modules():
    code = ("import sys, jax.numpy as jnp\n"
            "from pallas_kernels import flash_attention\n"
            "q = jnp.ones((1, 64, 2, 64), jnp.float32)\n"
            "flash_attention(q, q, q, interpret=True).block_until_ready()\n"
            "print(sorted(m for m in sys.modules if m.startswith('pallas_kernels.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(pathlib.Path.home())},
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.strip().splitlines()[-1]
    assert "pallas_kernels.flash_attention" in loaded and "mosaic" not in loaded, loaded


@pytest.mark.parametrize("overrides,platform,message", [
    (("model.attention_impl=pallas", "model.hidden_size=96", "model.num_heads=4", "model.num_kv_heads=2"), None,
     "model.attention_impl: 'pallas' needs head_dim a power of two"),
    (("model.attention_impl=mosaic", "model.dtype=float32"), None, "model.attention_impl: 'mosaic' computes in bf16"),
    (("model.attention_impl=cudnn",), "cpu", "model.attention_impl: 'cudnn' needs an NVIDIA GPU"),
    (("model.rope_impl=pallas", "model.hidden_size=96", "model.num_heads=4", "model.num_kv_heads=2"), None,
     "model.rope_impl: 'pallas' needs head_dim/2 a power of two"),
])
def test_check_names_the_field(overrides, platform, message):
    cfg = config_lib.load(None, list(overrides), validate_config=False)
    with pytest.raises(config_lib.ConfigError) as err:
        kernels.check(cfg, platform)
    assert str(err.value).startswith(message) and len(str(err.value).splitlines()) == 1, str(err.value)
