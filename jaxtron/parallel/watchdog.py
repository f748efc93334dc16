"""A lost or hung peer ends every other process of a multi-process run with one ``error:`` line.

Without this, JAX's coordination service notices a dead peer only when its heartbeats time out and then aborts
every survivor from C++ (SIGABRT, exit 134, a check-failure stack that names no process); a Python callback for
that path cannot be installed in this jaxlib (it fails with ``std::bad_cast``). So each process runs a thread
that, every ``interval`` seconds, writes its own beat counter into the coordination service's key-value store
(``jaxtron/alive/<process>``) and reads everyone's in one call:

* a peer whose counter has not moved for ``timeout`` seconds (killed, crashed, stopped, its node lost) ends
  this process: ``error: process 1 of 2 stopped answering for 10 s (killed, crashed, stopped or its node
  lost); exiting``, exit status 75;
* a peer that ended with an error says so first (``jaxtron/failed/<process>``), and the others repeat it;
* if the store itself stops answering (a call fails, or hangs for ``timeout`` seconds: a second thread judges
  that), process 0, which hosts it (in a child process of its own, :mod:`jaxtron.parallel.coordination_service`,
  which outlives a killed process 0), is gone: the line names it.

A peer on the same machine (same boot, same pid namespace: each process publishes its pid) whose process is
gone or a zombie is named at the next beat: a SIGKILLed peer's collective does not always fail at once. When a
collective fails first (a killed peer's sockets close), :meth:`PeerWatchdog.silent_peers` names the processes
whose beats stopped within a few seconds.

A process that finished cleanly marks itself done, so the others do not mistake its silence for a failure.
The thread holds the GIL only for microseconds per beat, so long compiles do not starve it. JAX's own heartbeat
timeout is set above ``timeout`` and stays as the last resort.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a scheduler may restart the job from its last checkpoint
PREFIX = "jaxtron/"


def machine_id() -> str:
    """This machine and pid namespace (pids compare only within one): boot id and namespace inode."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{socket.gethostname()}/unknown-ns/{os.getpid()}"  # never equal to a peer's: no local checks


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a killed child not yet reaped by its parent is a zombie
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class PeerWatchdog:
    def __init__(self, client, process_id: int, num_processes: int, timeout: float, interval: float = 1.0,
                 exit_fn: Callable[[int], None] = os._exit):
        self.client, self.pid, self.n = client, process_id, num_processes
        self.timeout, self.interval, self._exit = timeout, interval, exit_fn
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._beat = 0
        self._local: Optional[dict[int, int]] = None  # peers on this machine: process -> pid

    def start(self) -> "PeerWatchdog":
        self._set("alive", "0")
        self._set("pid", f"{machine_id()} {os.getpid()}")
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="jaxtron-peer-watchdog", daemon=True)
        self._thread.start()
        # a call into the store of a stopped process 0 may never return: this thread notices the beat thread hang
        threading.Thread(target=self._judge, name="jaxtron-peer-watchdog-judge", daemon=True).start()
        atexit.register(self.finish)  # registered after jax's own shutdown hook, so it runs before it
        previous = sys.excepthook

        def excepthook(kind, value, tb):  # an uncaught error: the others should not wait for this process
            previous(kind, value, tb)
            text = str(value).strip()
            self.finish(error=f"{kind.__name__}: {text.splitlines()[0][:300] if text else ''}")

        sys.excepthook = excepthook
        return self

    def finish(self, error: Optional[str] = None) -> None:
        """Stop watching; tell the others this process ended cleanly, or with ``error`` (one line)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._set("failed" if error else "done", error or "1")
        except Exception:  # the store may already be gone at exit; nothing to tell then
            pass

    def silent_peers(self, window: float = 3.0) -> list[int]:
        """The processes (not done, not this one) whose beat counter does not move for ``window`` seconds;
        process 0 alone if the store itself does not answer."""
        try:
            before, done = self._read("alive"), self._read("done")
            time.sleep(window)
            after = self._read("alive")
        except Exception:
            return [0] if self.pid != 0 else []
        return [q for q in range(self.n) if q != self.pid and q not in done and before.get(q) == after.get(q)]

    # ------------------------------------------------------------------------------------------ internals
    def _set(self, kind: str, value: str) -> None:
        self.client.key_value_set(f"{PREFIX}{kind}/{self.pid}", value, allow_overwrite=True)

    def _read(self, kind: str) -> dict[int, str]:
        return {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(f"{PREFIX}{kind}/")}

    def _lost(self, message: str) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        sys.stderr.write(f"error: {message}; exiting\n")
        sys.stderr.flush()
        self._exit(EXIT_PEER_LOST)

    def _gone_here(self, done: dict) -> list[int]:
        """Peers on this machine (same boot, same pid namespace) whose process has ended or is a zombie: a
        SIGKILLed peer is named at the next beat, not after ``timeout`` (its collective may not fail at once)."""
        local = self._local
        if local is None:  # until every peer has said where it runs
            me, pids = machine_id(), {q: v for q, v in self._read("pid").items() if q != self.pid}
            local = {q: int(v.split()[1]) for q, v in pids.items() if v.split()[0] == me}
            if len(pids) == self.n - 1:
                self._local = local
        return [q for q, pid in sorted(local.items()) if q not in done and not _running(pid)]

    def _judge(self) -> None:
        while not self._stop.wait(self.interval):
            if time.monotonic() - self._last_ok > self.timeout:
                self._lost(f"lost process 0 of {self.n} (it hosts the coordination service, which has not "
                           f"answered for {self.timeout:g} s: stopped or its node lost)")
                return

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}
        while not self._stop.wait(self.interval):
            try:
                self._beat += 1
                self._set("alive", str(self._beat))
                failed, done, alive = self._read("failed"), self._read("done"), self._read("alive")
            except Exception as err:
                if self._stop.is_set():
                    return
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                self._lost(f"lost process 0 of {self.n} (it hosts the coordination service, which stopped "
                           f"answering: {first[:200]})")
                return
            self._last_ok = time.monotonic()
            for q, why in sorted(failed.items()):
                if q != self.pid:
                    self._lost(f"process {q} of {self.n} failed: {why}")
                    return
            for q in self._gone_here(done):
                self._lost(f"process {q} of {self.n} was killed or crashed (its process on this machine is gone)")
                return
            now = time.monotonic()
            for q in range(self.n):
                if q == self.pid or q in done:
                    continue
                beat = alive.get(q, "")
                if q not in last or last[q][0] != beat:
                    last[q] = (beat, now)
                elif now - last[q][1] > self.timeout:
                    self._lost(f"process {q} of {self.n} stopped answering for {self.timeout:g} s (killed, "
                               "crashed, stopped or its node lost)")
                    return
