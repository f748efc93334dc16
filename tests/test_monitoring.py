"""The monitors on their own: who is named a straggler from a health table, the loss-spike detector, and the
Prometheus endpoint (skipped without prometheus_client). tests/test_launch.py runs them in real multi-process
runs (a straggler named, a hang ended)."""

import urllib.request

import numpy as np
import pytest

from helpers import tiny_config

from jaxtron.train import monitoring


def _table(arrivals, step_times, data_waits=None):
    n = len(arrivals)
    rows = np.zeros((n, len(monitoring.FIELDS)))
    rows[:, monitoring.FIELDS.index("arrival")] = arrivals
    rows[:, monitoring.FIELDS.index("step_time_s")] = step_times
    rows[:, monitoring.FIELDS.index("data_wait_s")] = data_waits or [0.0] * n
    return rows


def test_the_late_process_is_the_straggler():
    # process 2 reaches the log point 0.5 s after the others; every process's step takes 1 s (they wait for it)
    slow = monitoring.slowdowns(_table([100.0, 100.01, 100.5, 100.0], [1.0] * 4))
    assert int(np.argmax(slow)) == 2 and slow[2] == pytest.approx(1.5, abs=0.02)
    assert slow[[0, 1, 3]] == pytest.approx(1.0, abs=0.02)
    # two processes: the punctual one is the reference (the lower median)
    assert monitoring.slowdowns(_table([10.0, 10.4], [0.8, 0.8]))[1] == pytest.approx(1.5)


def test_arrivals_wrap_around_the_clock():
    wrap = monitoring.CLOCK_WRAP
    late = monitoring.lateness(_table([wrap - 0.1, 0.2], [1.0, 1.0]))  # 0.3 s apart across the wrap
    assert late == pytest.approx([0.0, 0.3], abs=1e-6)


class _Trainer:
    def __init__(self):
        self.stopped = None

    def request_stop(self, reason):
        self.stopped = reason


@pytest.mark.parametrize("action", ["log", "stop"])
def test_loss_spike(action, caplog):
    cfg = tiny_config("monitor.loss_spike_window=4", "monitor.loss_spike_threshold=0.5",
                      f"monitor.loss_spike_action={action}")
    det, trainer = monitoring.LossSpikeDetector(cfg), _Trainer()
    losses = [3.0, 2.9, 2.8, 2.7, 4.5, 2.6, 2.5]  # 4.5 > 1.5 x the median 2.85
    with caplog.at_level("WARNING", logger="jaxtron"):
        for step, loss in enumerate(losses, 1):
            det.on_step(step, {"loss": np.float32(loss)}, trainer)
    assert det.spikes == 1
    assert "loss spike at step 5: 4.5000 against a median of 2.8500" in caplog.text
    assert (trainer.stopped is not None) == (action == "stop")
    record = {}
    det.on_log(7, record, trainer)
    assert record == {"loss_spikes": 1}


def test_prometheus_endpoint():
    pytest.importorskip("prometheus_client")
    from jaxtron.train.prometheus import PrometheusExporter

    exporter = PrometheusExporter(0)  # any free port
    try:
        table = _table([1.0, 1.2], [0.5, 0.5], [0.01, 0.02])
        table[:, monitoring.FIELDS.index("host_memory_gib")] = [1.0, 2.0]
        exporter.update(20, {"loss": 2.5, "tokens_per_s": 1000.0, "straggler_slowdown": 1.4, "stragglers": "x"},
                        table, monitoring.FIELDS)
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    assert "jaxtron_step 20.0" in text and "jaxtron_loss 2.5" in text
    assert "jaxtron_straggler_slowdown 1.4" in text
    assert 'jaxtron_process_data_wait_seconds{process="1"} 0.02' in text
    line = next(x for x in text.splitlines() if x.startswith('jaxtron_process_host_memory_bytes{process="1"}'))
    assert float(line.split()[-1]) == 2.0 * 2**30
