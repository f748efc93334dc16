"""JAX's coordination service in a process of its own, started by process 0 of a multi-process run.

JAX hosts the service inside process 0. When that process is killed, every other process's client sees the
service's socket close within milliseconds and aborts from C++ (``client.h:80] Terminating process``, SIGABRT,
exit 134); the client's ``missed_heartbeat_callback`` cannot replace that abort in this jaxlib (calling it fails
with ``std::bad_cast``). Hosted here instead, the service outlives a killed process 0, so the survivors find out
the way they do for any other peer: their next collective fails, or jaxtron's watchdog sees process 0's beats
stop, and each exits with one ``error:`` line naming process 0.

Run as ``python -m jaxtron.parallel.coordination_service BIND NUM_PROCESSES HEARTBEAT_S LINGER_S``. It prints
``ready`` (or ``error: ...``) on stdout once, then waits on stdin: ``done`` (process 0 ended cleanly, after its
shutdown barrier) ends it ``DONE_GRACE_S`` later; end-of-file without ``done`` (process 0 was killed) keeps it serving the
survivors for ``LINGER_S`` seconds, long enough for their watchdogs, then it ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time

# The shutdown barrier answers every process at once, but process 0 may read its answer first and send
# ``done`` while the others' answers are still in flight; a service that ended then would fail their
# ShutdownTask RPC, and JAX's client aborts from C++ (exit 134) at the end of a run that succeeded.
DONE_GRACE_S = 2.0


def main(argv: list[str]) -> int:
    bind, num_processes, heartbeat_s, linger_s = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    # A Ctrl-C or a scheduler's SIGTERM reaches the whole process group; process 0 saves and exits, and this
    # process follows it through stdin, not through the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from jax._src.lib import _jax  # jaxlib only: no backend, no devices

    try:
        service = _jax.get_distributed_runtime_service(bind, num_processes, heartbeat_timeout=heartbeat_s)
    except Exception as err:  # the port is taken, the address is bad
        text = str(err).strip()
        print(f"error: {text.splitlines()[0] if text else type(err).__name__}", flush=True)
        return 1
    print("ready", flush=True)
    time.sleep(DONE_GRACE_S if sys.stdin.readline().strip() == "done" else linger_s)
    # no shutdown here (the service's destructor waits for clients that have left or are gone): just end
    os._exit(0 if service is not None else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
