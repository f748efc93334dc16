"""Elastic restarts: re-laying a run's mesh on fewer devices without changing what it computes.

A restart on fewer processes keeps every axis that shapes the model's computation (tensor, stage, context,
expert) and shrinks the data-parallel axes (``data`` first, then ``fsdp``). The global batch stays the same
and so does the micro batch per replica, so gradient accumulation grows to make up for the lost replicas:
the sample order (a function of the config and the step) and the per-step loss are unchanged, up to the
reassociation of the gradient sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxtron.config import Config, ConfigError
from jaxtron.parallel.axes import AXES, DATA, FSDP, data_parallel_size
from jaxtron.parallel.layout import micro_batch_size, resolve_sizes

SHRINKABLE = (DATA, FSDP)  # the axes a restart on fewer devices may shrink, first to last


@dataclass(frozen=True)
class Relayout:
    devices: int
    sizes: dict             # axis -> size
    micro_batch_size: int   # per data-parallel replica
    accumulation: int       # micro batches per optimizer step

    def overrides(self) -> list[str]:
        """Config overrides that give this layout."""
        return [f"parallel.{a}={self.sizes[a]}" for a in SHRINKABLE] + [
            f"train.micro_batch_size={self.micro_batch_size}"]

    def describe(self) -> str:
        return (f"{self.devices} devices, " + " x ".join(f"{a} {self.sizes[a]}" for a in AXES if self.sizes[a] > 1)
                + f", micro batch {self.micro_batch_size} x {self.accumulation} accumulation")


def current(cfg: Config, devices: int) -> Relayout:
    """The layout ``cfg`` gives on ``devices`` devices (ConfigError when it does not fit them)."""
    sizes = resolve_sizes(cfg.parallel, devices)
    dp = data_parallel_size(sizes)
    mb = micro_batch_size(cfg, dp)
    return Relayout(devices, sizes, mb, cfg.train.global_batch_size // (mb * dp))


def shrink(cfg: Config, devices: int, new_devices: int) -> Relayout:
    """The layout of ``cfg`` (laid out on ``devices``) moved to ``new_devices`` devices: the data-parallel
    axes shrink, the global batch and the micro batch per replica stay (accumulation grows). ConfigError,
    naming what does not divide, when no such layout exists."""
    old = current(cfg, devices)
    fixed = math.prod(v for a, v in old.sizes.items() if a not in SHRINKABLE)
    if new_devices % fixed:
        raise ConfigError("parallel", f"cannot re-lay the mesh on {new_devices} devices: the axes that stay "
                                      f"({' x '.join(f'{a} {v}' for a, v in old.sizes.items() if a not in SHRINKABLE and v > 1) or 'none'}"
                                      f" = {fixed}) do not divide it")
    replicas = new_devices // fixed  # data x fsdp on the new mesh
    fsdp = max(f for f in range(1, old.sizes[FSDP] + 1) if replicas % f == 0 and old.sizes[FSDP] % f == 0)
    sizes = {**old.sizes, DATA: replicas // fsdp, FSDP: fsdp}
    dp = data_parallel_size(sizes)
    gbs = cfg.train.global_batch_size
    fits = [m for m in range(old.micro_batch_size, 0, -1) if gbs % (m * dp) == 0]
    if not fits:
        raise ConfigError("train.global_batch_size", f"{gbs} cannot be split over {dp} data-parallel replicas "
                                                     f"(a restart on {new_devices} devices)")
    return Relayout(new_devices, sizes, fits[0], gbs // (fits[0] * dp))


def largest_fit(cfg: Config, devices: int, devices_per_process: int, at_most: int, at_least: int) -> int:
    """The most processes in ``at_least..at_most`` whose devices the run can be re-laid on (0: none)."""
    for n in range(at_most, at_least - 1, -1):
        try:
            shrink(cfg, devices, n * devices_per_process)
            return n
        except ConfigError:
            continue
    return 0
