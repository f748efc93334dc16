"""Run the Mosaic GPU kernels' interpreter tests in a Python 3.12 virtual environment with jax 0.11.

Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`) is public from jax 0.11, which needs Python >= 3.12;
the repository's CI runs Python 3.11 with jax 0.10.2, where those tests skip themselves. This script finds a
Python 3.12 (pyenv's, or `python3.12` on PATH), builds a virtual environment with the pinned versions below
once (cached under ~/.cache/jaxtron/py312-env/<key>, the key a hash of the pins, of pyproject.toml's
dependencies and of the interpreter), and runs the selected tests there against this working tree
(PYTHONPATH, nothing of the repository is installed). `tests/test_kernels_mosaic_py312.py` calls it in CI.

    python scripts/mosaic_py312.py                 # build the environment if needed, run the selection
    python scripts/mosaic_py312.py --rebuild       # delete the cached environment first
    python scripts/mosaic_py312.py -- -x -k causal # extra pytest arguments (appended)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JAX_VERSION = "0.11.2"       # the GPU machines' jax (docs/performance.md); the Mosaic interpreter is public from 0.11
# Installed: these, plus pyproject.toml's [project].dependencies (jaxtron itself is imported from the tree).
REQUIREMENTS = [f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", "pytest==9.2.0", "numpy==2.5.5"]
# Constraints: the versions one resolve of the above gave on Python 3.12.1 (2026-11). A dependency pyproject.toml
# gains later is not pinned here and resolves freely (the cache key changes with it, so the env is rebuilt).
LOCK = """
absl-py==2.5.1 aiofiles==25.1.0 anyio==4.16.0 array_record==0.8.6 chex==0.1.92 click==8.5.1 cloudpickle==3.1.2
etils==1.15.0 filelock==4.2.12 flax==0.12.12 fsspec==2026.9.0 grain==0.2.18 h11==0.16.0 hf-xet==1.8.0
httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 humanize==4.17.0 idna==3.20 iniconfig==2.3.1
jax==0.11.2 jaxlib==0.11.2 markdown-it-py==4.3.0 mdurl==0.1.2 ml_dtypes==0.6.0 msgpack==1.2.4 numpy==2.5.5
omegaconf==2.4.0 opt_einsum==3.4.0 optax==0.2.8 orbax-checkpoint==0.12.8 packaging==26.3 pluggy==1.7.0
portpicker==1.6.0 prometheus_client==0.26.0 protobuf==7.36.2 psutil==7.2.2 Pygments==2.21.0 pytest==9.2.0
PyYAML==6.0.3 rich==15.0.0 safetensors==0.8.0 scipy==1.18.1 sentencepiece==0.2.3 simplejson==4.3.0
tensorboardX==2.6.5 tensorstore==0.1.86 tokenizers==0.23.3 toolz==1.2.0 tqdm==4.70.1 treescope==0.1.10
truststore==0.10.5 typing_extensions==4.16.0 uvloop==0.23.0 zipp==4.1.2
""".split()

# What runs: every test of the Mosaic kernels' own file (the interpreter numerics, and the cuda lowering and
# validation on jax 0.11 too) and the Mosaic cases of the model and config tests, but not
#  * test_mosaic_interpret_without_interpreter_says_so: it is for a JAX without the interpreter (it runs on 3.11);
#  * test_mosaic_attention_trains_like_pallas: 3 interpreted training steps of a 2-layer model, 150 s on a 2-core
#    machine alone; the kernels under it are checked through the same model dispatch by
#    test_mosaic_attention_gradients_match_xla (packed documents, fused and separate dq).
TEST_FILES = ["tests/test_kernels_flash_attention_mosaic.py", "tests/test_kernels_in_model.py", "tests/test_config.py"]
SELECTION = "mosaic and not interpret_without_interpreter and not trains_like_pallas"
MIN_PASSED = 30              # 33 when written: 25 + 2 + 6; fewer means the selection lost tests
# The interpreter needs 4 XLA CPU threads (max of cores and CPU devices): force devices on small machines.
DEVICES = 8
# about 4 minutes on a quiet 2-core machine; the suite's other workers can slow it 4x (a whole suite took 73 min
# instead of 18 on a loaded one): the limit is for a hung interpreter, not for a slow machine
TEST_TIMEOUT_S = float(os.environ.get("JAXTRON_PY312_TIMEOUT_S", 2400))
INSTALL_TIMEOUT_S = 1200


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxtron", "py312-env")


def _version_key(path: str):
    m = re.search(r"3\.12\.(\d+)", path)
    return int(m.group(1)) if m else -1


def _probe(python: str) -> dict | None:
    """The interpreter's version and real path when it is a working CPython 3.12 with venv and ensurepip."""
    code = ("import sys, json, venv, ensurepip; "
            "print(json.dumps({'version': list(sys.version_info[:3]), 'executable': sys.executable}))")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    if info["version"][:2] != [3, 12]:
        return None
    info["executable"] = os.path.realpath(info["executable"])
    return info


def candidates() -> list[str]:
    """Python 3.12 interpreters to try, best first: $JAXTRON_PY312, pyenv's newest 3.12.x, python3.12 on PATH."""
    out = []
    if os.environ.get("JAXTRON_PY312"):
        out.append(os.environ["JAXTRON_PY312"])
    roots = [os.environ.get("PYENV_ROOT"), os.path.join(os.path.expanduser("~"), ".pyenv")]
    if shutil.which("pyenv"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            roots.append(subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30).stdout.strip())
    found = set()
    for root in filter(None, roots):
        found.update(glob.glob(os.path.join(root, "versions", "3.12*", "bin", "python3.12")))
    out += sorted(found, key=_version_key, reverse=True)
    if shutil.which("python3.12"):
        out.append(shutil.which("python3.12"))
    return out


def find_python312() -> dict | None:
    for python in candidates():
        info = _probe(python)
        if info:
            return info
    return None


def _env_key(info: dict, requirements: list[str]) -> str:
    blob = json.dumps({"python": info, "requirements": requirements, "lock": LOCK}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def requirements() -> list[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return REQUIREMENTS + list(deps)


def env_python(env: str) -> str:
    return os.path.join(env, "bin", "python")


HEALTH = ("import jax, pytest, flax, optax; from jax.experimental.pallas import mosaic_gpu as plgpu; "
          f"assert jax.__version__ == {JAX_VERSION!r}, jax.__version__; "
          "assert hasattr(plgpu, 'InterpretGPUParams'), 'no Mosaic GPU interpreter'")


# For a cached environment (built and checked with HEALTH before it was marked complete): the installed
# distributions' metadata, without importing jax (seconds of the CI test's time on every run).
INSTALLED = ("import importlib.metadata as m; "
             f"assert m.version('jax') == m.version('jaxlib') == {JAX_VERSION!r}; "
             "[m.version(name) for name in ('pytest', 'flax', 'optax', 'numpy')]")


def imports_ok(env: str) -> bool:
    """The environment's jax is the pinned one and has Mosaic GPU's interpreter."""
    if not os.path.exists(env_python(env)):
        return False
    proc = subprocess.run([env_python(env), "-c", HEALTH], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return proc.returncode == 0


def installed_ok(env: str) -> bool:
    """A cached environment still holds the pinned jax and the test dependencies (metadata only)."""
    if not os.path.exists(env_python(env)):
        return False
    proc = subprocess.run([env_python(env), "-c", INSTALLED], capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


@contextlib.contextmanager
def _locked(path: str):
    """One builder at a time (pytest-xdist workers, other checkouts on the same machine)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_env(info: dict, rebuild: bool = False, log=print) -> tuple[str, float]:
    """The cached environment's directory (built if missing or broken) and the seconds spent building it."""
    reqs = requirements()
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    env = os.path.join(root, _env_key(info, reqs))
    with _locked(os.path.join(root, ".lock")):
        if not rebuild and os.path.exists(os.path.join(env, ".complete")) and installed_ok(env):
            return env, 0.0
        start = time.monotonic()
        for old in glob.glob(os.path.join(root, "*")):            # a broken env, and envs of older keys
            if os.path.isdir(old):
                shutil.rmtree(old, ignore_errors=True)
        log(f"building a Python {'.'.join(map(str, info['version']))} virtual environment for the Mosaic GPU "
            f"interpreter tests (jax {JAX_VERSION}, about 800 MB, minutes; once) in {env}; JAXTRON_NO_PY312=1 "
            f"skips them")
        subprocess.run([info["executable"], "-m", "venv", env], check=True, timeout=300)
        with open(os.path.join(env, "requirements.txt"), "w") as f:
            f.write("\n".join(reqs) + "\n")
        with open(os.path.join(env, "constraints.txt"), "w") as f:
            f.write("\n".join(LOCK) + "\n")
        cmd = [env_python(env), "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
               "-r", os.path.join(env, "requirements.txt"), "-c", os.path.join(env, "constraints.txt")]
        with open(os.path.join(env, "install.log"), "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S)
        if proc.returncode != 0 or not imports_ok(env):
            with open(os.path.join(env, "install.log")) as f:
                tail = f.read()[-4000:]
            shutil.rmtree(env, ignore_errors=True)
            raise RuntimeError(f"building the Python 3.12 env failed (pip exit {proc.returncode}):\n{tail}")
        seconds = time.monotonic() - start
        with open(os.path.join(env, ".complete"), "w") as f:
            json.dump({"python": info, "build_seconds": round(seconds, 1)}, f)
        return env, seconds


def test_env() -> dict:
    """The subprocess' environment: this tree on PYTHONPATH, forced CPU devices, no parent pytest state."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "PYTHON", "VIRTUAL_ENV", "XLA_FLAGS"))}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={DEVICES}"]),
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO, PYTHONDONTWRITEBYTECODE="1")
    return env


def summary_counts(output: str) -> dict | None:
    """pytest's closing line as {'passed': 25, 'deselected': 61, ...}, or None when there is none."""
    for line in reversed(output.splitlines()):
        m = re.match(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", line.strip())
        if m:
            return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", m.group(1))}
    return None


def run_tests(env: str, extra: list[str] = (), timeout: float = TEST_TIMEOUT_S) -> tuple[int, str, float]:
    """Exit code (124 on timeout), combined output and seconds of the pytest run in the cached environment."""
    cmd = [env_python(env), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
           "-o", "faulthandler_timeout=300", *TEST_FILES, "-k", SELECTION, *extra]
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:       # a file, not a pipe: what a killed run printed is kept
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=test_env(), stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        output = out.read()
    if rc == 124:
        output += f"\n[mosaic_py312] pytest killed after {timeout:.0f} s\n"
    return rc, output, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached environment")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    info = find_python312()
    if info is None:
        print("no Python 3.12 found (tried: " + ", ".join(candidates() or ["nothing"]) + "); install one with "
              "`pyenv install 3.12` or set JAXTRON_PY312=/path/to/python3.12", file=sys.stderr)
        return 2
    env, build_s = ensure_env(info, rebuild=args.rebuild)
    print(f"env {env} ({'built in %.0f s' % build_s if build_s else 'cached'})", flush=True)
    rc, output, test_s = run_tests(env, args.pytest_args)
    print(output[-6000:])
    print(f"pytest exit {rc} after {test_s:.0f} s; summary {summary_counts(output)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
