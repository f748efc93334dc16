"""Joining a multi-process run: ``jax.distributed.initialize`` from explicit settings, a Kubernetes JobSet, SLURM
or Open MPI.

Explicit settings come from ``distributed.*`` config fields or the environment (``JAXTRON_COORDINATOR=host:port``,
``JAXTRON_NUM_PROCESSES``, ``JAXTRON_PROCESS_ID``); in a JobSet pod from its indices
(:mod:`jaxtron.parallel.kubernetes`); under SLURM (``srun``, more than one task) or Open MPI
(``mpirun``, more than one rank) JAX's own cluster detection finds them. A single process initializes
nothing. XLA's collectives (NCCL on GPU, gloo on CPU) carry the traffic; the coordination service's heartbeats
and jaxtron's watchdog (:mod:`jaxtron.parallel.watchdog`, ``train.collective_timeout_s``) make every process
exit with one ``error:`` line naming the lost process when one of them dies or hangs. Process 0 runs the
coordination service in a child process (:mod:`jaxtron.parallel.coordination_service`), so that killing process 0
ends the others the same way rather than with JAX's C++ abort.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from jaxtron.config import Config, ConfigError
from jaxtron.parallel import kubernetes
from jaxtron.parallel.watchdog import EXIT_PEER_LOST, PeerWatchdog

log = logging.getLogger("jaxtron")

ENV = {"coordinator": "JAXTRON_COORDINATOR", "num_processes": "JAXTRON_NUM_PROCESSES",
       "process_id": "JAXTRON_PROCESS_ID"}


def _setting(cfg: Config, name: str) -> Optional[str]:
    value = getattr(cfg.distributed, name)
    if value is not None:
        return str(value)
    return os.environ.get(ENV[name]) or None


def _int(value: str, field: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(field, f"must be an integer, got {value!r}") from None


def launch_mode(cfg: Config) -> str:
    """'explicit', 'kubernetes', 'slurm', 'mpi' or 'single'."""
    if any(_setting(cfg, n) for n in ENV):
        return "explicit"
    if kubernetes.detected():  # a JobSet pod (jaxtron.parallel.kubernetes)
        return "kubernetes"
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in os.environ:
        return "slurm"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "mpi"
    return "single"


def initialize(cfg: Config) -> int:
    """Join the run described by ``cfg``/the environment; returns the number of processes."""
    import jax

    mode = launch_mode(cfg)
    if mode == "single":
        return 1
    # jaxtron's watchdog ends the run after collective_timeout_s with one line; JAX's heartbeats (which abort
    # from C++) stay behind it as the last resort
    kwargs = dict(initialization_timeout=cfg.distributed.initialization_timeout_s,
                  heartbeat_timeout_seconds=cfg.train.collective_timeout_s + 30)
    if mode == "explicit":
        coordinator = _setting(cfg, "coordinator")
        num = _setting(cfg, "num_processes")
        pid = _setting(cfg, "process_id")
        missing = [f"distributed.{n} ({ENV[n]})" for n, v in
                   (("coordinator", coordinator), ("num_processes", num), ("process_id", pid)) if v is None]
        if missing:
            raise ConfigError("distributed", "a multi-process run needs all of coordinator, num_processes and "
                                             f"process_id; missing: {', '.join(missing)}")
        num_i = _int(num, "distributed.num_processes")
        pid_i = _int(pid, "distributed.process_id")
        if not 0 <= pid_i < num_i:
            raise ConfigError("distributed.process_id", f"{pid_i} is not in 0..{num_i - 1}")
        if num_i == 1:
            return 1
        if ":" not in coordinator:
            raise ConfigError("distributed.coordinator", f"expected host:port, got {coordinator!r}")
        _join(coordinator, num_i, pid_i, None, cfg, kwargs)
    elif mode == "kubernetes":
        pod = kubernetes.pod()
        if pod.num_pods == 1:
            return 1
        _join(pod.coordinator, pod.num_pods, pod.pod_rank, None, cfg, kwargs)
    else:  # JAX's SLURM / Open MPI cluster detection
        from jax._src.clusters import ClusterEnv
        coordinator, num_i, pid_i, local_ids = ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, kwargs["initialization_timeout"])
        _join(coordinator, num_i, pid_i, local_ids, cfg, kwargs)
    log.debug("joined %s run: process %d of %d", mode, jax.process_index(), jax.process_count())
    if "cpu" in (os.environ.get("JAX_PLATFORMS") or str(jax.config.jax_platforms or "")).split(","):
        _drop_gloo_banners()
    _start_watchdog(cfg.train.collective_timeout_s)
    return jax.process_count()


_STDOUT_DRAIN = None


class GlooBannerFilter:
    """Gloo's ``[Gloo] Rank 0 is connected to ...`` banners taken out of a byte stream, line by line: ``feed``
    returns the complete lines to pass on, ``end`` what is left. Gloo writes a banner in pieces, so two
    communicators' banners can interleave mid-line: one line then holds both texts, or a tail (" is connected to
    3 peer ranks. Expected number of connected peer ranks is : 3") sits on a line of its own, and the second
    newline arrives alone. Blank lines right after a banner are such newlines and go too."""

    def __init__(self):
        self.rest = b""
        self.after_banner = False

    @staticmethod
    def banner(line: bytes) -> bool:
        return b"[Gloo] " in line or b"connected peer ranks" in line

    def _keep(self, line: bytes) -> bool:
        if self.banner(line):
            self.after_banner = True
            return False
        if self.after_banner and not line.strip():
            return False
        self.after_banner = False
        return True

    def feed(self, chunk: bytes) -> bytes:
        *lines, self.rest = (self.rest + chunk).split(b"\n")
        return b"".join(line + b"\n" for line in lines if self._keep(line))

    def end(self) -> bytes:
        rest, self.rest = self.rest, b""
        return rest if rest and self._keep(rest) else b""


def _drop_gloo_banners() -> None:
    """Gloo (XLA:CPU's collectives) prints ``[Gloo] Rank 0 is connected to 1 peer ranks ...`` from C++ on stdout
    at every new communicator, interleaved between the processes and its threads. File descriptor 1 goes through
    a pipe whose reader passes on every other line; at exit (or before ``os._exit``) the pipe is drained and fd 1
    restored."""
    import atexit
    import sys
    import threading

    global _STDOUT_DRAIN
    if _STDOUT_DRAIN is not None:
        return
    sys.stdout.flush()
    real = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump() -> None:
        lines = GlooBannerFilter()
        while chunk := os.read(read_end, 65536):
            kept = lines.feed(chunk)
            if kept:
                os.write(real, kept)
        kept = lines.end()
        if kept:
            os.write(real, kept)
        os.close(read_end)

    thread = threading.Thread(target=pump, name="jaxtron-stdout-filter", daemon=True)
    thread.start()

    def drain() -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real, 1)  # the pipe's last write end here: the reader sees its end once children let go
        thread.join(timeout=2.0)

    _STDOUT_DRAIN = drain
    atexit.register(drain)


def _before_exit() -> None:
    if _STDOUT_DRAIN is not None:
        _STDOUT_DRAIN()


def _join(coordinator: str, num: int, pid: int, local_ids, cfg: Config, kwargs: dict) -> None:
    """``jax.distributed.initialize``, except that process 0 hosts the coordination service in a process of
    its own (:mod:`jaxtron.parallel.coordination_service`), so that killing process 0 does not abort the
    others from C++."""
    import jax

    if pid != 0:
        jax.distributed.initialize(coordinator, num, pid, local_ids, **kwargs)
        return
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("jaxtron.parallel.distributed.initialize must run before JAX initializes a backend")
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or "[::]:" + coordinator.rsplit(":", 1)[1]
    _start_service(bind, num, kwargs["heartbeat_timeout_seconds"], kwargs["initialization_timeout"])
    state = jax_distributed.global_state  # what State.initialize sets, less the service it would start
    if local_ids:
        ids = ",".join(str(i) for i in local_ids)
        jax.config.update("jax_cuda_visible_devices", ids)
        jax.config.update("jax_rocm_visible_devices", ids)
    state.coordinator_address, state.process_id, state.num_processes = coordinator, pid, num
    state.client = _jax.get_distributed_runtime_client(
        coordinator, pid, init_timeout=kwargs["initialization_timeout"], use_compression=True,
        heartbeat_timeout=kwargs["heartbeat_timeout_seconds"])
    state.client.connect()
    state.initialize_preemption_sync_manager()
    partition = os.environ.get("JAX_PARTITION_INDEX")
    state.partition_index = int(partition) if partition is not None else None


_SERVICE = None


def _start_service(bind: str, num: int, heartbeat_s: int, timeout_s: float) -> None:
    import atexit
    import select
    import subprocess
    import sys

    global _SERVICE
    # after process 0 is killed it serves the survivors past JAX's heartbeat timeout: by then their
    # watchdogs (train.collective_timeout_s, shorter) have ended them
    linger = heartbeat_s + 10
    proc = subprocess.Popen([sys.executable, "-m", "jaxtron.parallel.coordination_service", bind, str(num),
                             str(heartbeat_s), str(linger)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else f"no answer in {timeout_s:g} s"
    if line != "ready":
        proc.kill()
        raise ConfigError("distributed.coordinator", f"the coordination service could not start on {bind}: "
                                                     f"{line.removeprefix('error: ') or 'it exited'}")
    _SERVICE = proc
    atexit.register(_service_done)


def _service_done() -> None:
    """At a clean exit of process 0: leave JAX's shutdown barrier first, then end the service."""
    import jax

    try:
        jax.distributed.shutdown()
    finally:
        try:
            _SERVICE.stdin.write("done\n")
            _SERVICE.stdin.close()
        except OSError:
            pass
        try:  # its port is free again when this process ends (a restart may bind it at once)
            _SERVICE.wait(timeout=30)
        except Exception:
            _SERVICE.kill()


_WATCHDOG = None


def _start_watchdog(timeout: float) -> None:
    global _WATCHDOG
    import jax
    from jax._src import distributed as jax_distributed  # the client of the coordination service

    client = jax_distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return
    _WATCHDOG = PeerWatchdog(client, jax.process_index(), jax.process_count(), timeout,
                             exit_fn=_exit_now).start()


def _exit_now(status: int) -> None:
    _before_exit()
    os._exit(status)


def exit_lost_peer(message: str) -> None:
    """End this process now with one ``error:`` line (exit status 75), telling the others first."""
    import sys

    report_failure(message)
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    _before_exit()
    os._exit(EXIT_PEER_LOST)


def lost_peers(window: float = 3.0) -> list[int]:
    """After a failed collective: the processes whose beats stopped (see ``PeerWatchdog.silent_peers``)."""
    return _WATCHDOG.silent_peers(window) if _WATCHDOG is not None else []


def report_failure(message: str) -> None:
    """Tell the other processes that this one ends with ``message`` (they exit repeating it)."""
    if _WATCHDOG is not None:
        _WATCHDOG.finish(error=message)
