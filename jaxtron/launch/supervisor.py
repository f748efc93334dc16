"""The supervisor: run this node's training processes, and restart the job when any of them fails.

One attempt starts ``processes`` copies of ``python -m jaxtron.train`` (joined into one JAX distributed run
through ``JAXTRON_COORDINATOR``/``JAXTRON_NUM_PROCESSES``/``JAXTRON_PROCESS_ID``) and waits. When one fails
(a non-zero exit, a signal, a hang ended by the watchdog or the hang detector) the others are killed (they can
neither finish a step nor write a checkpoint without it), the newest checkpoint is verified (shard sizes and checksums;
a bad one is set aside as ``<step>.corrupt``) and the next attempt resumes from the newest good one, after a
backoff that doubles with each restart, until ``max_restarts`` restarts are spent.

A process killed by a SIGKILL the supervisor did not send (the OOM killer, an operator, a node agent taking
the device away) counts its slot as lost. With ``min_processes`` below ``processes``, the next attempt runs without
the lost slots: the mesh is re-laid on the devices that are left (:mod:`jaxtron.parallel.elastic`; the global
batch and sample order stay, accumulation grows). A process that exits with an error is restarted in place.
Exit status 2 (a bad config) and 3 (the run's own verdict, e.g. too many non-finite steps) are not retried.

Every attempt and its outcome is one ``launch:`` line on stderr and one row of ``<output_dir>/launch.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from jaxtron.config import Config
from jaxtron.parallel import elastic

FATAL = {2: "a bad config", 3: "the run stopped itself (e.g. too many non-finite steps)"}


@dataclass
class Options:
    processes: int = 1                  # processes on this node
    cpu_devices: Optional[int] = None   # virtual CPU devices per process (a local CPU run); None: the real ones
    gpus_per_process: Optional[int] = None  # each slot sees its own GPUs (CUDA_VISIBLE_DEVICES); None: all
    min_processes: Optional[int] = None  # shrink down to this many after lost slots (default: never shrink)
    max_restarts: int = 3
    backoff_s: float = 5.0              # first restart's wait; doubles with each restart
    max_backoff_s: float = 300.0
    grace_s: float = 30.0               # SIGTERM -> SIGKILL
    nodes: int = 1                      # supervisors in the job (one per node)
    node_rank: int = 0
    coordinator: Optional[str] = None   # host:port of process 0 (multi-node); attempt k uses port + k
    kubernetes: bool = False            # a JobSet pod (nodes, rank and coordinator came from its environment)
    module: str = "jaxtron.train"
    python: str = sys.executable


@dataclass
class Outcome:
    """How one attempt ended."""
    status: int                                       # 0: every process finished cleanly
    first: str = ""                                   # the first failure, one line
    lost: list = field(default_factory=list)          # slots whose process a foreign SIGKILL took away
    stopped: bool = False                             # the supervisor itself was asked to stop


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Child:
    """One training process; its stderr is passed through and its last ``error:`` line remembered."""

    def __init__(self, slot: int, pid_in_run: int, cmd: list, env: dict):
        self.slot, self.pid_in_run = slot, pid_in_run
        self.signalled = False  # the supervisor sent it a signal
        self.ended: Optional[float] = None  # when the supervisor saw it end
        self.error: Optional[str] = None
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            sys.stderr.write(line)
            if line.startswith("error:"):
                self.error = line[len("error:"):].strip()
        sys.stderr.flush()

    @property
    def lost(self) -> bool:
        """Taken away from outside: a SIGKILL the supervisor did not send."""
        return self.proc.returncode == -signal.SIGKILL and not self.signalled

    def describe(self) -> str:
        rc = self.proc.returncode
        how = f"was killed by {_signal_name(rc)}" if rc < 0 else f"exited with status {rc}"
        return f"process {self.pid_in_run} (pid {self.proc.pid}) {how}" + (f": {self.error}" if self.error else "")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.signalled = True
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def join(self) -> None:
        self.proc.wait()
        self._reader.join(timeout=5)


class Supervisor:
    def __init__(self, cfg: Config, train_args: list, opts: Options):
        self.cfg, self.train_args, self.o = cfg, list(train_args), opts
        self.devices_per_process = opts.cpu_devices or opts.gpus_per_process or 1
        self._stop_signal: Optional[str] = None
        self._children: list[_Child] = []
        self.events_path = os.path.join(cfg.train.output_dir, "launch.jsonl")

    # ---------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        o = self.o
        slots = list(range(o.processes))
        restarts, attempt = 0, 0
        layout_note = ""
        overrides: list = []
        self._install_signals()
        while True:
            step = self._newest_good_checkpoint()
            self._say(f"attempt {attempt}: starting {len(slots)} process(es) on node {o.node_rank} of {o.nodes}"
                      + (f", resuming from checkpoint step {step}" if step is not None else ", from scratch")
                      + layout_note, attempt=attempt, processes=len(slots), checkpoint_step=step,
                      overrides=overrides)
            out = self._attempt(attempt, slots, overrides)
            if out.status == 0 or out.stopped:
                why = f"stopped by {self._stop_signal}" if out.stopped else "finished"
                self._say(f"attempt {attempt}: {why} (status {out.status}) after {restarts} restart(s)",
                          attempt=attempt, status=out.status, restarts=restarts, end=True)
                return out.status
            self._say(f"attempt {attempt} failed: {out.first}", attempt=attempt, status=out.status,
                      failure=out.first, lost_slots=out.lost)
            if out.status in FATAL:
                self._fail(f"not restarting: {FATAL[out.status]} ({out.first})")
                return out.status
            if restarts >= o.max_restarts:
                self._fail(f"giving up after {restarts} restart(s) (--max-restarts {o.max_restarts}); "
                           f"last failure: {out.first}")
                return out.status
            restarts += 1
            attempt += 1
            if out.lost and o.min_processes is not None and o.min_processes < len(slots):
                slots, overrides, layout_note = self._shrink(slots, out.lost, overrides)
            wait = min(o.backoff_s * 2 ** (restarts - 1), o.max_backoff_s)
            self._say(f"restart {restarts} of at most {o.max_restarts} in {wait:g} s")
            if self._sleep(wait):
                self._say(f"stopped by {self._stop_signal} while waiting to restart")
                return 0

    def _shrink(self, slots: list, lost: list, overrides: list) -> tuple[list, list, str]:
        """Drop the lost slots, down to min_processes, if the run can be re-laid on what is left."""
        o, per = self.o, self.devices_per_process
        left = [s for s in slots if s not in lost]
        full = o.processes * per
        n = elastic.largest_fit(self.cfg, full, per, len(left), o.min_processes) if left else 0
        if n == 0:
            self._say(f"cannot shrink below {len(slots)} process(es) (--min-processes {o.min_processes}); "
                      f"restarting on all of them")
            return slots, overrides, ""
        new = elastic.shrink(self.cfg, full, n * per)
        was = elastic.current(self.cfg, len(slots) * per) if not overrides else None
        before = was.describe() if was else f"{len(slots)} process(es)"
        self._say(f"shrinking: slot(s) {', '.join(map(str, lost))} lost; {len(slots)} -> {n} process(es); mesh "
                  f"{before} -> {new.describe()} (global batch {self.cfg.train.global_batch_size} unchanged)",
                  shrink_to=n, layout=new.sizes, micro_batch_size=new.micro_batch_size,
                  accumulation=new.accumulation)
        return left[:n], new.overrides(), f"; re-laid mesh: {new.describe()}"

    # ------------------------------------------------------------------------------------------ attempt
    def _attempt(self, attempt: int, slots: list, overrides: list) -> Outcome:
        o = self.o
        num = len(slots) * o.nodes
        if o.coordinator:
            host, port = o.coordinator.rsplit(":", 1)
            coordinator = f"{host}:{int(port) + attempt}"  # the last attempt's port may still be held
        else:
            coordinator = f"127.0.0.1:{_free_port()}"
        cmd = [o.python, "-m", o.module, *self.train_args, *overrides]
        self._children = []
        for i, slot in enumerate(slots):
            pid = o.node_rank * len(slots) + i
            env = dict(os.environ, JAXTRON_LAUNCH_ATTEMPT=str(attempt), JAXTRON_LAUNCH_SLOT=str(slot))
            if o.kubernetes and len(slots) == 1:
                # one process per JobSet pod: it finds its place from the pod's environment itself
                # (jaxtron.parallel.kubernetes); only the attempt's port is the supervisor's
                env["JAXTRON_COORDINATOR_PORT"] = coordinator.rsplit(":", 1)[1]
            else:
                env.update(JAXTRON_COORDINATOR=coordinator, JAXTRON_NUM_PROCESSES=str(num),
                           JAXTRON_PROCESS_ID=str(pid))
            if o.gpus_per_process:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    str(g) for g in range(slot * o.gpus_per_process, (slot + 1) * o.gpus_per_process))
            if o.cpu_devices:
                env["JAX_PLATFORMS"] = "cpu"
                env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                    f" --xla_force_host_platform_device_count={o.cpu_devices}").strip()
            self._children.append(_Child(slot, pid, cmd, env))
        first: Optional[_Child] = None
        kill_at: Optional[float] = None
        while True:
            now = time.monotonic()
            running = [c for c in self._children if c.proc.poll() is None]
            for c in self._children:
                if c.ended is None and c.proc.returncode is not None:
                    c.ended = now
            if first is None:
                failed = [c for c in self._children if c.proc.returncode not in (None, 0)]
                if failed:
                    # the origin: a lost process before one that failed, before those that exited (75) because a
                    # peer was lost; then the first to end
                    first = min(failed, key=lambda c: (not c.lost, c.proc.returncode == 75, c.ended))
                    # the others can neither finish a step nor save a checkpoint without it: no grace period
                    self._stop_all(signal.SIGKILL)
            if self._stop_signal and kill_at is None:
                self._stop_all(signal.SIGTERM)
                kill_at = time.monotonic() + o.grace_s
            if not running:
                break
            if kill_at is not None and time.monotonic() > kill_at:
                self._stop_all(signal.SIGKILL)
            time.sleep(0.1)
        for c in self._children:
            c.join()
        if first is None:
            bad = [c for c in self._children if c.proc.returncode != 0]
            first = bad[0] if bad else None
        if first is None:
            return Outcome(0, stopped=self._stop_signal is not None)
        lost = [c.slot for c in self._children if c.lost]
        return Outcome(first.proc.returncode if first.proc.returncode > 0 else 128 - first.proc.returncode,
                       first.describe(), lost, stopped=self._stop_signal is not None and not lost)

    def _stop_all(self, sig: int) -> None:
        for c in self._children:
            c.signal(sig)

    # ------------------------------------------------------------------------------------- checkpoints
    def _newest_good_checkpoint(self) -> Optional[int]:
        """The newest checkpoint step whose files verify; newer bad ones are set aside (node 0 only: the
        directory is shared)."""
        from jaxtron.config import checkpoint_dir

        if not self.cfg.checkpoint.enabled:
            return None
        directory = checkpoint_dir(self.cfg)
        if not os.path.isdir(directory):
            return None
        steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)
        if not steps:
            return None
        if self.o.node_rank != 0:
            return steps[0]
        from jaxtron.checkpoint.integrity import verify_step  # file I/O only

        for step in steps:
            problems, _ = verify_step(os.path.join(directory, str(step)))
            if not problems:
                return step
            src = os.path.join(directory, str(step))
            dst, n = f"{src}.corrupt", 0
            while os.path.exists(dst):
                n += 1
                dst = f"{src}.corrupt.{n}"
            os.rename(src, dst)
            self._say(f"checkpoint step {step} failed verification ({problems[0]}"
                      f"{f'; {len(problems) - 1} more' if len(problems) > 1 else ''}); set aside as {dst}",
                      set_aside=step)
        return None

    # -------------------------------------------------------------------------------------------- misc
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handle(signum, frame):
            self._stop_signal = signal.Signals(signum).name
            self._say(f"received {self._stop_signal}: asking the processes to save and stop")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handle)

    def _sleep(self, seconds: float) -> bool:
        """Wait; True if a stop signal came meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self._stop_signal:
                return True
            time.sleep(min(0.1, end - time.monotonic()) if end > time.monotonic() else 0)
        return self._stop_signal is not None

    def _say(self, message: str, **event) -> None:
        sys.stderr.write(f"launch: {message}\n")
        sys.stderr.flush()
        if self.o.node_rank != 0:
            return
        try:
            os.makedirs(os.path.dirname(self.events_path) or ".", exist_ok=True)
            with open(self.events_path, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), "message": message, **event}) + "\n")
        except OSError:
            pass  # the log line above is what matters

    def _fail(self, message: str) -> None:
        self._say(message)
        sys.stderr.write(f"error: launch: {message}\n")
        sys.stderr.flush()
