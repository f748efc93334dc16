"""Fault injection for tests and failure drills: ``JAXTRON_FAULTS`` makes a training process fail on purpose.

``JAXTRON_FAULTS="ACTION@KEY=VALUE,...;..."``, one fault per ``;``-separated entry:

* ``kill@step=5,process=1``: SIGKILL itself after optimizer step 5 (a lost node: the supervisor, with
  ``--min-processes``, restarts without this slot);
* ``exit@step=5,process=0``: exit with status 1 and one ``error:`` line (a crash: restarted in place);
* ``sleep=0.5@step=3,process=1``: sleep 0.5 s after every step from step 3 on (a straggler);
* ``hang@step=6,process=1``: stop making progress after step 6 (a hang, for the hang detector).

Keys: ``step`` (default 1), ``process`` (the JAX process index; default every process) and ``attempt`` (the
supervisor's ``JAXTRON_LAUNCH_ATTEMPT``, default 0: a restarted run does not fail again). A bad entry is a
one-line error naming it. Nothing happens without the variable; ``python -m jaxtron.train`` installs the
injector only when it is set.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

from jaxtron.config import ConfigError
from jaxtron.train.callbacks import Callback

ENV = "JAXTRON_FAULTS"
ACTIONS = ("kill", "exit", "sleep", "hang")


@dataclass(frozen=True)
class Fault:
    action: str
    value: float = 0.0
    step: int = 1
    process: Optional[int] = None
    attempt: int = 0


def parse(text: str) -> list[Fault]:
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        head, _, keys = entry.partition("@")
        action, _, value = head.partition("=")
        try:
            if action not in ACTIONS:
                raise ValueError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
            kw = {}
            for pair in filter(None, keys.split(",")):
                key, _, v = pair.partition("=")
                if key not in ("step", "process", "attempt"):
                    raise ValueError(f"unknown key {key!r} (step, process, attempt)")
                kw[key] = int(v)
            faults.append(Fault(action, float(value) if value else 0.0, **kw))
        except ValueError as err:
            raise ConfigError(ENV, f"{entry!r}: {err}") from None
    return faults


class FaultInjector(Callback):
    """Carries out the faults meant for this process and attempt after the steps they name."""

    def __init__(self, faults: list[Fault], process: int, attempt: int):
        self.faults = [f for f in faults if f.process in (None, process) and f.attempt == attempt]
        self.process = process

    def on_step(self, step, metrics, trainer):
        for f in self.faults:
            if f.action == "sleep" and step >= f.step:
                time.sleep(f.value)
            elif step == f.step:
                self._act(f, step)

    def _act(self, f: Fault, step: int) -> None:
        what = f"injected fault ({ENV}): {f.action} after step {step} on process {self.process}"
        sys.stderr.write(f"{what}\n")
        sys.stderr.flush()
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "exit":
            from jaxtron.parallel.distributed import report_failure
            report_failure(what)
            sys.stderr.write(f"error: {what}\n")
            sys.stderr.flush()
            os._exit(int(f.value) or 1)
        elif f.action == "hang":
            while True:
                time.sleep(3600)


def from_environment(process: int) -> list[Callback]:
    """The injector for ``JAXTRON_FAULTS`` (none when it is unset)."""
    text = os.environ.get(ENV)
    if not text:
        return []
    attempt = int(os.environ.get("JAXTRON_LAUNCH_ATTEMPT", "0") or 0)
    return [FaultInjector(parse(text), process, attempt)]
