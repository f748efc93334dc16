"""Where metrics go: ``<output_dir>/metrics.jsonl``, TensorBoard (tensorboardX) and a tqdm progress bar.
Only process 0 writes."""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
from tqdm import tqdm


class MetricsWriter:
    def __init__(self, output_dir: str, total_steps: int, tensorboard: bool, progress: bool, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        self._bar: Optional[tqdm] = None
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: (float(v) if v is not None else None) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if v is not None:
                    self._tb.add_scalar(k, float(v), step)
        if self._bar is not None and "loss" in metrics:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
