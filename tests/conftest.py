"""Tests run on the CPU with 8 virtual devices (set before JAX initializes its backends)."""

import os
import shutil
import tempfile

# The suite compiles hundreds of small programs and runs each a few steps, so LLVM's optimization of the CPU
# code costs more than it saves: level 0 halves the suite's time. XLA's HLO passes (fusion, sharding,
# collectives: what the tests look at) are unchanged; this process's children (the CLI runs) inherit it.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _share_compiled_programs() -> str | None:
    """One persistent XLA compilation cache for the whole run: the xdist workers and the subprocesses the tests
    start (the CLI; not the multi-process runs, see test_multihost.py) inherit JAX_COMPILATION_CACHE_DIR, so a
    program that many tests compile (the tiny model's train step on one layout, the one-device reference of the
    equality tests) is compiled once. Compiling dominates this suite's time on CPU. The run starts with an empty cache, made here (in the
    xdist controller, before it starts the workers) and removed at the end; a cache the caller set is left
    alone."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    path = tempfile.mkdtemp(prefix="jaxtron-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    return path


_OWN_CACHE = _share_compiled_programs()

from jaxtron.jax_startup import import_jax  # noqa: E402

import_jax()  # the first import of JAX in each test process: without the CUDA plugin's driver-probe lines

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first, so the 2 xdist workers do not end the suite waiting on one long test
    (the Python 3.12 Mosaic run alone takes about 4 minutes). The order is otherwise unchanged."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _jaxtron_logger_restored():
    """run() gives the "jaxtron" logger its own stderr handler and stops propagation; without this, whether a
    later test's caplog sees jaxtron's records would depend on which tests ran before it on the same worker."""
    logger = logging.getLogger("jaxtron")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
