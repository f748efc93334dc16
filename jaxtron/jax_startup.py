"""Importing JAX on a machine without an NVIDIA driver, without the CUDA plugin's noise.

The ``test`` and ``plan`` extras install JAX's CUDA plugin (to compile for GPUs that are not there). On a
machine with no NVIDIA driver, ``import jax`` then prints "Could not find cuda drivers" from C++ once per CUDA
module, and the first use of the devices logs a "Jax plugin configuration error" traceback. On such a machine
:func:`import_jax` drops those lines from the C-level stderr of the import and, when no ``JAX_PLATFORMS`` is
chosen and no TPU runtime is installed, asks for the CPU platform, which skips the plugin's CUDA check. Everything else
written to stderr meanwhile is passed on. With a driver present, nothing is changed. ``import jaxtron`` does
not import JAX, but it installs :func:`quiet_jax_import`, so that the user's own ``import jax`` after it is
quiet the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import sys
import tempfile
from typing import Optional

PLUGIN_EXTENSIONS = ("jax_cuda12_plugin.cuda_plugin_extension", "jax_cuda12_plugin._versions",
                     "jax_cuda13_plugin.cuda_plugin_extension", "jax_cuda13_plugin._versions")
PLUGIN_PACKAGES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
NOISE = (b"Could not find cuda drivers", b"All log messages before absl::InitializeLog() is called")


def nvidia_driver_present() -> bool:
    if os.path.exists("/proc/driver/nvidia/version"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _load_cuda_plugin_libraries() -> None:
    """Load now what the CUDA plugin loads when the devices are first used (its extension modules and its
    PJRT library): the driver probe in each runs once per process, here, inside the filter."""
    for module in PLUGIN_EXTENSIONS:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    for plugin in PLUGIN_PACKAGES:
        try:
            spec = importlib.util.find_spec(plugin)
        except ImportError:
            continue
        if spec is not None and spec.origin:
            library = os.path.join(os.path.dirname(spec.origin), "xla_cuda_plugin.so")
            if os.path.exists(library):
                try:
                    ctypes.CDLL(library)
                except OSError:
                    pass


class FilteredStderr:
    """What :func:`stderr_filtered` yields: ``dropped`` (pattern -> lines dropped, filled at the end) and
    :meth:`say`, which writes a line to the real stderr at once (progress that should not wait for the end)."""

    def __init__(self, drop: tuple[bytes, ...]):
        self.dropped = dict.fromkeys(drop, 0)
        self.real_fd: Optional[int] = None

    def say(self, line: str) -> None:
        sys.stderr.flush()
        os.write(self.real_fd if self.real_fd is not None else 2, (line + "\n").encode())


@contextlib.contextmanager
def stderr_filtered(drop: tuple[bytes, ...]):
    """Route file descriptor 2 (C++ logging writes there, not to ``sys.stderr``) through a temporary file; at the
    end pass on every line that contains none of ``drop`` (yields a :class:`FilteredStderr`)."""
    state = FilteredStderr(drop)
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (some embedded interpreters): leave it alone
        yield state
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        state.real_fd = saved
        try:
            yield state
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            state.real_fd = None
            tmp.seek(0)
            kept = []
            for line in tmp:
                hit = next((d for d in drop if d in line), None)
                if hit is None:
                    kept.append(line)
                else:
                    state.dropped[hit] += 1
            if kept:
                os.write(2, b"".join(kept))


def _without_noise_on_stderr():
    return stderr_filtered(NOISE)


def _use_cpu_unless_chosen(jax) -> None:
    if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms \
            and importlib.util.find_spec("libtpu") is None:
        jax.config.update("jax_platforms", "cpu")


class _QuietLoader:
    """Executes ``jax`` inside the stderr filter, then hands the module its real loader back."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            with _without_noise_on_stderr():
                self.inner.exec_module(module)
                _load_cuda_plugin_libraries()
        finally:
            module.__loader__ = module.__spec__.loader = self.inner
        _use_cpu_unless_chosen(module)


class _QuietJaxFinder:
    """A ``sys.meta_path`` entry that makes the next ``import jax`` (the user's own, after ``import jaxtron``)
    load as :func:`import_jax` does; it removes itself at that import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "jax":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _QuietLoader(spec.loader)
        return spec


def quiet_jax_import() -> None:
    """Called by ``import jaxtron`` (which does not import JAX): on a machine where the CUDA plugin is installed
    but no NVIDIA driver, a later ``import jax`` anywhere in the process is quiet too."""
    if "jax" in sys.modules or any(isinstance(f, _QuietJaxFinder) for f in sys.meta_path):
        return
    if importlib.util.find_spec("jax_plugins") is None or nvidia_driver_present():
        return
    sys.meta_path.insert(0, _QuietJaxFinder())


def import_jax():
    """``import jax``, quietly on a machine without a GPU (see the module docstring); returns the module."""
    if "jax" in sys.modules:
        return sys.modules["jax"]
    if importlib.util.find_spec("jax_plugins") is None or nvidia_driver_present():
        import jax
        return jax
    with _without_noise_on_stderr():
        import jax
        _load_cuda_plugin_libraries()  # each prints the line once, when first loaded
    _use_cpu_unless_chosen(jax)
    return jax
