"""SIGTERM/SIGINT during training: remember the signal so the loop can save a checkpoint and exit cleanly
(SLURM and Kubernetes send SIGTERM before killing a job; Ctrl-C sends SIGINT). A second SIGINT interrupts at
once."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

log = logging.getLogger("jaxtron.process")  # a signal reaches one process: each says what it got


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: Optional[str] = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = name
        log.warning("received %s: saving a checkpoint after this step, then exiting", name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
