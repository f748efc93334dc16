"""Joining a multi-process run: ``jax.distributed.initialize`` from explicit settings, SLURM or Open MPI.

Explicit settings come from ``distributed.*`` config fields or the environment (``JAXTRON_COORDINATOR=host:port``,
``JAXTRON_NUM_PROCESSES``, ``JAXTRON_PROCESS_ID``); under SLURM (``srun``, more than one task) or Open MPI
(``mpirun``, more than one rank) JAX's own cluster detection finds them. A single process initializes
nothing. XLA's collectives (NCCL on GPU, gloo on CPU) carry the traffic; the coordination service's heartbeats
(``train.collective_timeout_s``) make every process exit with an error when one of them dies or hangs.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from jaxtron.config import Config, ConfigError

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
    """'explicit', 'slurm', 'mpi' or 'single'."""
    if any(_setting(cfg, n) for n in ENV):
        return "explicit"
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
    kwargs = dict(initialization_timeout=cfg.distributed.initialization_timeout_s,
                  heartbeat_timeout_seconds=cfg.train.collective_timeout_s)
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
        jax.distributed.initialize(coordinator, num_i, pid_i, **kwargs)
    else:
        jax.distributed.initialize(**kwargs)  # JAX's SLURM / Open MPI cluster detection
    log.debug("joined %s run: process %d of %d", mode, jax.process_index(), jax.process_count())
    return jax.process_count()
