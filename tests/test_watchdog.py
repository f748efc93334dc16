"""jaxtron's peer watchdog against an in-memory key-value store (the multi-process tests run it for real)."""

import threading
import time

from jaxtron.parallel.watchdog import EXIT_PEER_LOST, PeerWatchdog


class Store:
    def __init__(self):
        self.kv, self.hang = {}, threading.Event()

    def key_value_set(self, key, value, allow_overwrite=False):
        while self.hang.is_set():  # process 0 stopped: calls never return
            time.sleep(0.01)
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in list(self.kv.items()) if k.startswith(prefix)]


def _watch(store, pid=0, n=2):
    exits = []
    dog = PeerWatchdog(store, pid, n, timeout=0.4, interval=0.05, exit_fn=exits.append)
    dog._set("alive", "0")
    dog._last_ok = time.monotonic()
    threading.Thread(target=dog._run, daemon=True).start()
    threading.Thread(target=dog._judge, daemon=True).start()
    return dog, exits


def _wait(cond, limit=5.0):
    t0 = time.time()
    while not cond() and time.time() - t0 < limit:
        time.sleep(0.02)


def test_a_silent_peer_is_named_after_the_timeout(capfd):
    store = Store()
    store.kv["jaxtron/alive/1"] = "7"  # process 1 beat once, then went silent
    _, exits = _watch(store)
    _wait(lambda: exits)
    assert exits == [EXIT_PEER_LOST]
    assert capfd.readouterr().err == ("error: process 1 of 2 stopped answering for 0.4 s (killed, crashed, "
                                      "stopped or its node lost); exiting\n")


def test_a_beating_or_finished_peer_is_not_lost():
    store = Store()
    _, exits = _watch(store, n=3)
    store.kv["jaxtron/done/2"] = "1"  # process 2 ended cleanly: its silence is fine
    stop = time.time() + 1.0
    beat = 0
    while time.time() < stop:  # process 1 keeps beating
        beat += 1
        store.kv["jaxtron/alive/1"] = str(beat)
        time.sleep(0.05)
    assert exits == []


def test_a_failed_peer_is_repeated(capfd):
    store = Store()
    store.kv["jaxtron/failed/1"] = "error: data.paths: x.bin not found"
    _, exits = _watch(store)
    _wait(lambda: exits)
    assert exits == [EXIT_PEER_LOST]
    assert "error: process 1 of 2 failed: error: data.paths: x.bin not found; exiting" in capfd.readouterr().err


def test_a_hung_store_names_process_0(capfd):
    store = Store()
    dog, exits = _watch(store, pid=1)
    store.kv["jaxtron/alive/0"] = "1"
    store.hang.set()
    _wait(lambda: exits)
    store.hang.clear()
    assert exits == [EXIT_PEER_LOST]
    assert "error: lost process 0 of 2 (it hosts the coordination service" in capfd.readouterr().err


def test_silent_peers_after_a_failed_collective():
    store = Store()
    dog = PeerWatchdog(store, 0, 3, timeout=100, interval=0.05, exit_fn=lambda s: None)
    store.kv.update({"jaxtron/alive/1": "5", "jaxtron/alive/2": "9"})
    threading.Timer(0.1, lambda: store.kv.update({"jaxtron/alive/2": "10"})).start()
    assert dog.silent_peers(window=0.3) == [1]
