"""Where metrics go: ``<output_dir>/metrics.jsonl``, TensorBoard (tensorboardX), one plain log line per log step
(:func:`log_line`) and, on a terminal, a tqdm progress bar. Only process 0 writes.

``metrics.jsonl`` is strict JSON, one object per line: ``step``, ``time`` (unix seconds), ``timestamp`` (ISO
8601, UTC) and the metrics, with ``null`` for values that are not finite (a skipped step's NaN loss). A run that
resumes from step ``s`` first drops the rows it will write again (steps after ``s``, or all rows when it starts
from 0), so a rollback (a checkpoint fallback, a resume from an older step) leaves no duplicates."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import sys
import time
from typing import Optional

import jax
import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

GIB = 2.0 ** 30


def _clean(v):
    """A JSON value: integers as int, other numbers as float (``None`` when not finite), strings and ``None``
    as they are."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    v = float(v)
    return v if math.isfinite(v) else None


def device_memory(devices=None) -> dict:
    """``memory_gib`` (in use) and ``memory_peak_gib``: the largest over this process's devices, from
    ``device.memory_stats()``; empty where the backend reports none (CPU)."""
    in_use, peak = [], []
    for d in devices if devices is not None else jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = None
        if not stats or "bytes_in_use" not in stats:
            continue
        in_use.append(stats["bytes_in_use"])
        peak.append(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
    if not in_use:
        return {}
    return {"memory_gib": max(in_use) / GIB, "memory_peak_gib": max(peak) / GIB}


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def log_line(step: int, total: int, r: dict) -> str:
    """The Megatron-style line of one log step, e.g. ``step 20/200 | loss 2.4312 | grad norm 0.813 | lr 2.960e-04 |
    199 ms/step | 41200 tokens/s (5150 per device) | 397 TFLOP/s per device | MFU 40.1% full attention (36.9%
    causal) | memory 31.20 GiB (peak 33.05) | skipped 0``. MFU and memory appear where they are known."""
    def fmt(key, spec, missing="n/a"):
        v = r.get(key)
        return missing if v is None else format(v, spec)

    parts = [f"step {step}/{total}", f"loss {fmt('loss', '.4f', 'nan')}", f"grad norm {fmt('grad_norm', '.3f', 'nan')}",
             f"lr {fmt('lr', '.3e')}"]
    if r.get("step_time_s") is not None:
        parts.append(f"{1000 * r['step_time_s']:.0f} ms/step")
    if r.get("tokens_per_s") is not None:
        parts.append(f"{_num(r['tokens_per_s'])} tokens/s ({_num(r['tokens_per_s_per_device'])} per device)")
    if r.get("tflops_per_device") is not None:
        parts.append(f"{r['tflops_per_device']:.3g} TFLOP/s per device")
    if r.get("mfu") is not None:
        causal = f" ({r['mfu_causal']:.1%} causal)" if r.get("mfu_causal") is not None else ""
        parts.append(f"MFU {r['mfu']:.1%} full attention{causal}")
    if r.get("moe_aux_loss") is not None:  # MoE models: router losses, worst layer's load, dropped assignments
        parts.append(f"moe aux {r['moe_aux_loss']:.4f} z {r['moe_z_loss']:.3g} load max/mean "
                     f"{r['moe_load_max_over_mean']:.2f} dropped {r['moe_dropped']:.2%}")
    if r.get("mtp_loss") is not None:  # multi-token prediction: the depths' mean cross entropy, before loss_coef
        parts.append(f"mtp loss {r['mtp_loss']:.4f}")
    if r.get("memory_gib") is not None:
        parts.append(f"memory {r['memory_gib']:.2f} GiB (peak {r['memory_peak_gib']:.2f})")
    if "skipped_steps" in r:
        parts.append(f"skipped {int(r['skipped_steps'])}")
    return " | ".join(parts)


def drop_rows_after(path: str, start_step: int) -> int:
    """Rewrite ``path`` without the rows a run starting at ``start_step`` writes again (step > start_step; every
    row when it is 0) and without unreadable lines; returns how many were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # e.g. a line cut short by a crash
        if step <= start_step and start_step > 0:
            keep.append(line)
    if len(keep) == len(lines):
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)


class MetricsWriter:
    def __init__(self, output_dir: str, total_steps: int, tensorboard: bool, progress: bool, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        self._bar: Optional[tqdm] = None
        self._redirect = contextlib.ExitStack()
        self.dropped = 0
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.dropped = drop_rows_after(self.path, start_step)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter
            # events of the steps this run writes again are hidden by TensorBoard (purge_step)
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                     purge_step=start_step + 1 if start_step else 0)
        if progress and sys.stderr.isatty():  # no carriage-return frames in log files
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            # until close(), jaxtron's log lines go above the bar instead of through it
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("jaxtron")]))

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        now = round(time.time(), 3)
        iso = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="milliseconds")
        record = {"step": step, "time": now, "timestamp": iso,
                  **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if v is not None and not isinstance(v, str):
                    self._tb.add_scalar(k, float(v), step)
        if self._bar is not None and "loss" in metrics:
            self._bar.set_postfix(loss=f"{record['loss'] if record['loss'] is not None else float('nan'):.4f}",
                                  refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        self._redirect.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
