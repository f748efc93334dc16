"""Tests run on the CPU with 8 virtual devices (set before JAX initializes its backends)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtron.jax_startup import import_jax  # noqa: E402

import_jax()  # the first import of JAX in each test process: without the CUDA plugin's driver-probe lines

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first, so the 2 xdist workers do not end the suite waiting on one long test
    (the Python 3.12 Mosaic run alone takes about 4 minutes). The order is otherwise unchanged."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
