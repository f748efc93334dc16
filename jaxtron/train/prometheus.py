"""The Prometheus endpoint of process 0 (``monitor.prometheus_port``; the ``monitoring`` extra installs
``prometheus_client``): the run's metrics at each log point as gauges, and each process's health labelled by
``process``. Scrape ``http://<process 0's host>:<port>/metrics``."""

from __future__ import annotations

import logging

import numpy as np

from jaxtron.config import ConfigError

log = logging.getLogger("jaxtron")

RUN_GAUGES = {  # metrics.jsonl key -> (gauge name, help)
    "loss": ("jaxtron_loss", "training loss per token at the last log step"),
    "grad_norm": ("jaxtron_grad_norm", "global gradient norm"),
    "lr": ("jaxtron_learning_rate", "learning rate"),
    "step_time_s": ("jaxtron_step_time_seconds", "mean seconds per optimizer step over the log window"),
    "tokens_per_s": ("jaxtron_tokens_per_second", "training throughput"),
    "mfu": ("jaxtron_mfu", "model FLOPs utilization (full attention)"),
    "consumed_samples": ("jaxtron_consumed_samples", "sequences trained on"),
    "skipped_steps": ("jaxtron_skipped_steps", "steps skipped for a non-finite loss or gradient"),
    "straggler_slowdown": ("jaxtron_straggler_slowdown", "the slowest process's slowdown against the median"),
    "loss_spikes": ("jaxtron_loss_spikes", "loss spikes detected"),
}
PROCESS_GAUGES = {  # column of the health monitor's table -> (gauge name, help, scale)
    "step_time_s": ("jaxtron_process_step_time_seconds", "seconds per step on this process", 1.0),
    "device_wait_s": ("jaxtron_process_device_wait_seconds", "seconds per step blocked on the device and "
                                                             "collectives", 1.0),
    "data_wait_s": ("jaxtron_process_data_wait_seconds", "seconds per step fetching the next batch", 1.0),
    "host_memory_gib": ("jaxtron_process_host_memory_bytes", "resident host memory", 2.0 ** 30),
    "device_memory_gib": ("jaxtron_process_device_memory_bytes", "device memory in use (largest local device)",
                          2.0 ** 30),
}


class PrometheusExporter:
    def __init__(self, port: int):
        try:
            import prometheus_client
        except ImportError:
            raise ConfigError("monitor.prometheus_port", "needs the prometheus_client package: "
                                                         "pip install 'jaxtron[monitoring]'") from None
        self.registry = prometheus_client.CollectorRegistry()
        gauge = prometheus_client.Gauge
        self.step = gauge("jaxtron_step", "optimizer steps done", registry=self.registry)
        self.run = {k: gauge(n, h, registry=self.registry) for k, (n, h) in RUN_GAUGES.items()}
        self.per_process = {c: (gauge(n, h, ["process"], registry=self.registry), s)
                            for c, (n, h, s) in PROCESS_GAUGES.items()}
        try:
            self.server, self.thread = prometheus_client.start_http_server(port, registry=self.registry)
        except OSError as err:
            raise ConfigError("monitor.prometheus_port", f"cannot serve on port {port}: {err}") from None
        log.info("Prometheus metrics on port %d (/metrics)", self.server.server_port)

    @property
    def port(self) -> int:
        return self.server.server_port

    def update(self, step: int, record: dict, table: np.ndarray, columns: tuple) -> None:
        """``table``: one row per process, ``columns`` naming its columns."""
        self.step.set(step)
        for key, g in self.run.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and np.isfinite(value):
                g.set(value)
        for column, (g, scale) in self.per_process.items():
            for q, value in enumerate(table[:, columns.index(column)]):
                g.labels(process=str(q)).set(float(value) * scale)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
