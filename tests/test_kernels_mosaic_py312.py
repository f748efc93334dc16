"""The Mosaic GPU kernels' interpreter tests, run in a Python 3.12 environment with jax 0.11 (scripts/mosaic_py312.py).

Mosaic GPU's interpreter is public from jax 0.11, which needs Python >= 3.12; this suite's own interpreter (Python
3.11, jax 0.10.2) skips those tests. So this one test finds a Python 3.12 (pyenv's, or python3.12 on PATH),
builds once a virtual environment with pinned jax/jaxlib 0.11.2, pytest and pyproject.toml's dependencies
(cached in ~/.cache/jaxtron/py312-env/<hash of the pins>), and runs there, on this working tree:

    pytest tests/test_kernels_flash_attention_mosaic.py tests/test_kernels_in_model.py tests/test_config.py
           -k "mosaic and not interpret_without_interpreter and not trains_like_pallas"

with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the interpreter needs 4 XLA CPU threads). That is every
test of the Mosaic kernels' file (forward and backward numerics against the reference, causal and packed
documents, both dq variants, vmap, document skipping, cuda lowering and validation on jax 0.11) and the Mosaic
cases of the model dispatch and config tests, about 4 minutes on a 2-core machine. Left out:
test_mosaic_interpret_without_interpreter_says_so (for a JAX without the interpreter: it runs here, in 3.11) and
test_mosaic_attention_trains_like_pallas (three interpreted training steps, 150 s alone; the same dispatch is
checked by test_mosaic_attention_gradients_match_xla). It passes only if pytest exits 0 with at least
MIN_PASSED passed and nothing skipped: a silent skip there would hide that the numerics did not run.

Building the environment is announced on the terminal (pytest's capture bypassed). The pytest run there is
limited to JAXTRON_PY312_TIMEOUT_S (default 2400 s: a hung interpreter, not a machine slowed by the suite's other
workers). No Python 3.12 is a failure, not a skip, unless JAXTRON_NO_PY312=1 says so. Under a JAX that has the
interpreter, the tests above ran in this very run, and this one skips itself.
"""

import importlib.util
import os
import sys

import jax
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("mosaic_py312", os.path.join(REPO, "scripts", "mosaic_py312.py"))
mosaic_py312 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mosaic_py312)


def _announce(line: str) -> None:
    print(f"\n[{os.path.basename(__file__)}] {line}", file=sys.__stderr__, flush=True)


def _tail(text: str, chars: int = 8000) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


@pytest.mark.slow
def test_mosaic_interpreter_tests_pass_in_python312_env():
    if hasattr(plgpu, "InterpretGPUParams"):
        pytest.skip(f"jax {jax.__version__} has Mosaic GPU's interpreter: the Mosaic interpreter tests ran in "
                    f"this interpreter")
    if os.environ.get("JAXTRON_NO_PY312") == "1":
        pytest.skip("JAXTRON_NO_PY312=1: the Mosaic GPU kernels' interpreter tests did NOT run")
    info = mosaic_py312.find_python312()
    assert info is not None, (
        "no Python 3.12 found for the Mosaic GPU interpreter tests (tried: "
        + ", ".join(mosaic_py312.candidates() or ["nothing"]) + "). Install one (`pyenv install 3.12`), point "
        "JAXTRON_PY312 at one, or set JAXTRON_NO_PY312=1 to run without the Mosaic kernels' numerics")

    # said on the terminal itself (pytest captures the test's output): an 800 MB download should not be silent
    env, build_s = mosaic_py312.ensure_env(info, log=_announce)
    rc, output, test_s = mosaic_py312.run_tests(env)
    counts = mosaic_py312.summary_counts(output) or {}
    print(f"Python 3.12 env {env}: {'built in %.0f s' % build_s if build_s else 'cached'}; "
          f"pytest {test_s:.0f} s, {counts}")
    assert rc == 0, f"the Mosaic tests failed in the Python 3.12 env (pytest exit {rc}):\n{_tail(output)}"
    assert counts.get("passed", 0) >= mosaic_py312.MIN_PASSED, (
        f"only {counts.get('passed', 0)} passed (expected >= {mosaic_py312.MIN_PASSED}): {counts}\n{_tail(output)}")
    bad = {k: n for k, n in counts.items() if k not in ("passed", "deselected", "warnings", "warning")}
    assert not bad, f"the Mosaic tests in the Python 3.12 env did not all run and pass: {counts}\n{_tail(output)}"


def test_the_second_environment_is_announced_where_it_is_built(monkeypatch, tmp_path):
    """The README's test section names what the suite builds, where, and how to skip it; the location is the
    one the script uses; the limit on its pytest run outlasts a suite slowed 4x (about 16 of the 4 minutes)."""
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme[readme.index('pip install -e ".[test]"'):readme.index("## Training")]
    for needle in ("~/.cache/jaxtron/py312-env", "800 MB", "JAXTRON_NO_PY312=1", "scripts/mosaic_py312.py"):
        assert needle in section, needle
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert mosaic_py312.cache_root() == str(tmp_path / ".cache" / "jaxtron" / "py312-env")
    assert mosaic_py312.TEST_TIMEOUT_S >= 4 * 4 * 60 * 1.5
