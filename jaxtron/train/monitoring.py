"""Run health for operations: per-process step time, data wait and memory, stragglers, hangs, loss spikes and an
optional Prometheus endpoint, as :class:`~jaxtron.train.callbacks.Callback` objects (``monitor.*`` config).

:class:`HealthMonitor` times every step on every process: ``step_time_s`` (one loop iteration), ``device_wait_s``
(blocked until the step's results are ready: computing, and waiting in collectives for the other processes)
and ``data_wait_s`` (fetching the next batch). At each log point the per-process window means, memory and the
wall-clock time at which each process reached the log point go through one small allgather; process 0 names
the slowest processes with their slowdown against the median and writes them to ``metrics.jsonl``
(``straggler_process``, ``straggler_slowdown``, ``stragglers``) and every process's figures to
``<output_dir>/health.jsonl``; at ``monitor.straggler_threshold`` it warns.

Who is slow: the processes meet at every step (the loop agrees on stopping, the gradients are reduced), so
every process's step time is the slowest one's. What differs is when each reaches the log point: a process
that is slow on the host (data loading, a busy or throttled CPU, a stalled file system, a long garbage
collection) arrives late, and the others wait for it. Its slowdown is ``1 + (late - median late) / median
step time``, ``late`` being how long after the first process it arrived: 1.5 means it holds every step up by
half a step more than the median process does. One sample per log point; across hosts the clocks must agree
to well under a step (NTP or PTP). A device that computes slowly makes every process wait for it inside the step and
cannot be told apart from here (that needs per-kernel timers, as NVIDIA's resiliency extension reads from
CUPTI): it shows as a longer step on all.

Hangs: a thread ends the process when no step has finished for ``monitor.hang_factor`` times the median of the
recent step times (at least ``monitor.hang_min_s``), with one ``error:`` line naming the step, what the main
thread was doing and where (its innermost frames), and, in a multi-process run, the processes that are behind
(each publishes its progress in the coordination service's key-value store). Evaluations and the end of the
run are not timed. The exit status is 75, as for a lost peer, so the supervisor restarts the run.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Optional

import jax
import numpy as np

from jaxtron.config import Config
from jaxtron.train.callbacks import Callback

log = logging.getLogger("jaxtron")

EXIT_HUNG = 75  # EX_TEMPFAIL, as a lost peer: restart from the last checkpoint
GIB = 2.0 ** 30
FIELDS = ("arrival", "step_time_s", "device_wait_s", "data_wait_s", "host_memory_gib", "device_memory_gib")
PROGRESS_KEY = "jaxtron/progress/"
CLOCK_WRAP = 3600.0  # float32 resolves 0.2 ms at this size


def host_memory_gib() -> float:
    """This process's resident memory (Linux ``/proc/self/statm``; the peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def lateness(table: np.ndarray) -> np.ndarray:
    """Seconds after the first process that each process (rows of FIELDS) reached the log point. Arrivals are
    wall-clock seconds modulo :data:`CLOCK_WRAP` (the gather carries float32)."""
    arrival = table[:, FIELDS.index("arrival")]
    rel = (arrival - arrival[0] + CLOCK_WRAP / 2) % CLOCK_WRAP - CLOCK_WRAP / 2
    return rel - rel.min()


def slowdowns(table: np.ndarray) -> np.ndarray:
    """Per process: ``1 + (late - median late) / median step time`` (the module's docstring says why); lower
    medians, so that with two processes the punctual one is the reference."""
    late = lateness(table)
    step = max(statistics.median_low(table[:, FIELDS.index("step_time_s")].tolist()), 1e-6)
    return 1.0 + (late - statistics.median_low(late.tolist())) / step


def _kv_client():
    from jax._src import distributed as jax_distributed  # the coordination service's key-value store
    return jax_distributed.global_state.client if jax.process_count() > 1 else None


def main_thread_frames(depth: int = 3) -> str:
    """The innermost frames of the main thread, innermost first (``file:line (function)``)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)[::-1][:depth]
    return " <- ".join(f"{_short(s.filename)}:{s.lineno} ({s.name})" for s in stack)


def _short(path: str) -> str:
    for marker in ("/jaxtron/", "/site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1] if marker == "/site-packages/" else "jaxtron/" + path.split(marker, 1)[1]
    return path


class HealthMonitor(Callback):
    def __init__(self, cfg: Config):
        self.m = cfg.monitor
        self.output_dir = cfg.train.output_dir
        self.process, self.count = jax.process_index(), jax.process_count()
        self.window: list = []
        self.recent = collections.deque(maxlen=20)  # step times for the hang detector's median
        self.last_ready: Optional[float] = None
        self.progress_at: Optional[float] = None
        self.step = 0
        self.last_step = cfg.train.steps
        self.eval_every = cfg.train.eval_every
        self.watching = False  # the hang detector times the current interval
        self.phase = "starting"
        self.data_wait_seen = 0.0
        self._stop = threading.Event()
        self._client = None
        self.prometheus = None

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_begin(self, step, trainer):
        self._stop.clear()
        self.step, self.last_ready, self.window = step, None, []
        self.data_wait_seen = trainer.data_wait_s
        self._client = _kv_client()
        if self.m.hang_factor > 0:
            threading.Thread(target=self._watch, name="jaxtron-hang-detector", daemon=True).start()
        if self.m.prometheus_port is not None and self.process == 0 and self.prometheus is None:
            from jaxtron.train.prometheus import PrometheusExporter
            self.prometheus = PrometheusExporter(self.m.prometheus_port)

    def on_step(self, step, metrics, trainer):
        entered = time.perf_counter()
        self.phase = f"waiting for step {step}'s results (computing, or in a collective waiting for a peer)"
        jax.block_until_ready(metrics["loss"])
        ready = time.perf_counter()
        seen = trainer.data_wait_s
        data_wait, self.data_wait_seen = seen - self.data_wait_seen, seen
        if self.last_ready is not None:
            iteration = ready - self.last_ready
            self.window.append((iteration, ready - entered, data_wait))
            self.recent.append(iteration)
        self.last_ready = self.progress_at = ready
        self.step = step
        # an evaluation (its first compiles the eval step) and the end of the run are not steps: not timed
        self.watching = step < self.last_step and not (self.eval_every and step % self.eval_every == 0)
        self.phase = (f"on the host after step {step} (fetching the next batch, logging, checkpointing or "
                      f"starting step {step + 1})")
        self._publish(step, 0)

    def on_eval(self, step, metrics, trainer):
        self.progress_at = time.perf_counter()
        self.watching = step < self.last_step

    def _publish(self, step: int, stage: int) -> None:
        """This process's progress for the others' hang reports: ``step.stage`` (0: the step finished, 1: at
        the step's health gather)."""
        if self._client is not None:
            try:
                self._client.key_value_set(f"{PROGRESS_KEY}{self.process}", f"{step}.{stage}", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the peer watchdog reports a lost store
                pass

    def on_log(self, step, record, trainer):
        if not self.window:
            return
        w = np.array(self.window)
        self.window = []
        step_time, device_wait, data_wait = (float(x) for x in w.mean(axis=0))
        mine = np.array([time.time() % CLOCK_WRAP, step_time, device_wait, data_wait, host_memory_gib(),
                         record.get("memory_gib") or 0.0], np.float64)
        if self.count > 1:
            from jax.experimental import multihost_utils
            self._publish(step, 1)
            self.phase = f"in the health gather of step {step} (waiting for the other processes to log)"
            table = np.asarray(multihost_utils.process_allgather(mine)).reshape(self.count, len(FIELDS))
            self.phase = f"on the host after step {step} (logging, checkpointing or starting step {step + 1})"
        else:
            table = mine[None]
        record.update(data_wait_s=data_wait, host_memory_gib=float(table[:, FIELDS.index("host_memory_gib")].max()))
        if self.count > 1:
            self._stragglers(step, table, record)
        if self.process == 0:
            self._write_health(step, table)
            if self.prometheus is not None:
                self.prometheus.update(step, record, table, FIELDS)

    def on_train_end(self, step, result, trainer):
        self._stop.set()

    # -------------------------------------------------------------------------------------- stragglers
    def _stragglers(self, step: int, table: np.ndarray, record: dict) -> None:
        slow = slowdowns(table)
        order = np.argsort(-slow)[:3]
        worst = int(order[0])
        late = lateness(table)
        data = table[:, FIELDS.index("data_wait_s")]
        record.update(straggler_process=worst, straggler_slowdown=float(slow[worst]),
                      stragglers=", ".join(f"process {q} {slow[q]:.2f}x" for q in order),
                      step_time_median_s=float(np.median(table[:, FIELDS.index("step_time_s")])),
                      data_wait_max_s=float(data.max()))
        if slow[worst] >= self.m.straggler_threshold:
            log.warning("straggler at step %d: process %d is %.2fx the median (it reached the log point %.3f s after "
                        "the first; its data wait %.3f s a step; the others wait for it); slowest: %s", step, worst,
                        slow[worst], late[worst], data[worst], record["stragglers"])

    def _write_health(self, step: int, table: np.ndarray) -> None:
        import json
        late, slow = lateness(table), slowdowns(table)
        rows = [{"process": q, **{k: round(float(v), 6) for k, v in zip(FIELDS, table[q])},
                 "late_s": round(float(late[q]), 6), "slowdown": round(float(slow[q]), 4)} for q in range(len(table))]
        try:
            with open(os.path.join(self.output_dir, "health.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "time": round(time.time(), 3), "processes": rows}) + "\n")
        except OSError as err:
            log.warning("health.jsonl: %s", err)

    # ------------------------------------------------------------------------------------------- hangs
    def _watch(self) -> None:
        m = self.m
        while not self._stop.wait(0.5):
            if not self.watching or self.progress_at is None or len(self.recent) < 2:
                continue  # armed once two steps have been timed (the first one includes warm-up)
            median = statistics.median(self.recent)
            limit = max(m.hang_factor * median, m.hang_min_s)
            quiet = time.perf_counter() - self.progress_at
            if quiet > limit:
                self._hung(quiet, limit, median)
                return

    def _hung(self, quiet: float, limit: float, median: float) -> None:
        message = (f"step {self.step + 1} hung on process {self.process}: no progress for {quiet:.0f} s (limit "
                   f"{limit:.0f} s: monitor.hang_factor={self.m.hang_factor:g} x the median step {median:.3f} s, at "
                   f"least monitor.hang_min_s={self.m.hang_min_s:g}); it was {self.phase}, in "
                   f"{main_thread_frames()}{self._behind()}")
        from jaxtron.parallel.distributed import report_failure
        report_failure(message)  # the other processes exit repeating it instead of waiting for their own limit
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        os._exit(EXIT_HUNG)

    def _behind(self) -> str:
        if self._client is None:
            return ""
        try:
            marks = {int(k.rsplit("/", 1)[1]): tuple(map(int, v.split(".")))
                     for k, v in self._client.key_value_dir_get(PROGRESS_KEY)}
        except Exception:  # noqa: BLE001 - the store may be gone with process 0
            return "; the other processes' progress is unknown (the coordination service does not answer)"
        if not marks:
            return ""
        ahead = max(marks.values())
        where = lambda m: f"step {m[0]}'s health gather" if m[1] else f"the end of step {m[0]}"  # noqa: E731
        behind = sorted(q for q, m in marks.items() if m < ahead)
        if not behind:
            return f"; every process reached {where(ahead)}"
        return "; behind: " + ", ".join(f"process {q} (at {where(marks[q])})" for q in behind) + \
            f"; the others reached {where(ahead)}"


class LossSpikeDetector(Callback):
    """A step whose loss exceeds the median of the last ``monitor.loss_spike_window`` losses by more than
    ``monitor.loss_spike_threshold`` (a fraction) is a spike: logged, or (``loss_spike_action=stop``) the run
    stops with a checkpoint (``Trainer.request_stop``) for a person to look at."""

    def __init__(self, cfg: Config):
        self.m = cfg.monitor
        self.losses = collections.deque(maxlen=self.m.loss_spike_window)
        self.spikes = 0

    def on_step(self, step, metrics, trainer):
        loss = float(metrics["loss"])
        full = len(self.losses) == self.losses.maxlen
        median = statistics.median(self.losses) if self.losses else None
        if full and np.isfinite(loss) and loss > median * (1 + self.m.loss_spike_threshold):
            self.spikes += 1
            what = (f"loss spike at step {step}: {loss:.4f} against a median of {median:.4f} over the last "
                    f"{len(self.losses)} steps (monitor.loss_spike_threshold={self.m.loss_spike_threshold:g})")
            if self.m.loss_spike_action == "stop":
                log.warning("%s; stopping (monitor.loss_spike_action=stop)", what)
                trainer.request_stop(what)
            else:
                log.warning("%s", what)
            return  # a spike does not enter the window it is judged against
        if np.isfinite(loss):
            self.losses.append(loss)

    def on_log(self, step, record, trainer):
        record["loss_spikes"] = self.spikes


def callbacks(cfg: Config) -> list[Callback]:
    """The monitors ``monitor.*`` asks for, and the fault injector when ``JAXTRON_FAULTS`` is set (after the
    health monitor, so that an injected sleep counts as this process's own time)."""
    from jaxtron.train import faults

    out: list[Callback] = []
    if cfg.monitor.health:
        out.append(HealthMonitor(cfg))
    if cfg.monitor.loss_spike_window:
        out.append(LossSpikeDetector(cfg))
    return out + faults.from_environment(jax.process_index())
