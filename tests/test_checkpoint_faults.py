"""Fault tolerance of real ``python -m jaxtron.train`` processes: SIGKILL in the middle of an asynchronous save,
SIGTERM (save and exit cleanly), and an unreadable newest checkpoint, one after the other in one run, each
followed by a restart. The restarted runs' losses equal an uninterrupted run's, bit for bit."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import TINY, cpu_xla_flags
from jaxtron.checkpoint.shards import WRITE_DELAY_ENV

STEPS = 12  # enough for a save every 2 steps to be in flight, and for retention to drop old ones
COMMON = TINY + ["data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1",
                 "train.eval_every=0", "logging.log_every=1", f"train.steps={STEPS}"]
ENV = {**os.environ, "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}


def _cmd(out, *extra):
    return [sys.executable, "-m", "jaxtron.train", *COMMON, f"train.output_dir={out}", *extra]


def _losses(out) -> dict:
    """step -> loss; the last record of a step wins (a resumed run appends to metrics.jsonl)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    losses = {}
    for line in open(path).read().splitlines():
        r = json.loads(line)
        if "loss" in r:
            losses[r["step"]] = r["loss"]
    return losses


def _run(out, *extra, env=ENV, timeout=300):
    return subprocess.run(_cmd(out, *extra), capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    proc = _run(out, "checkpoint.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _wait_for(predicate, proc, timeout=240):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


def _rows(out) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def test_sigkill_during_async_save_then_sigterm_then_a_damaged_checkpoint(tmp_path, reference):
    """One run through three faults, each followed by a restart: SIGKILL while the step-4 save is in flight
    (step 2's checkpoint is kept, the partial one cleaned up), SIGTERM to the restarted run (it saves and exits
    0), a truncated newest checkpoint (one error line; checkpoint.fallback=true resumes from the one before).
    The losses end equal to the uninterrupted run's, bit for bit, after the SIGTERM's restart and again after
    the fallback's."""
    out = str(tmp_path / "run")
    ckpt = os.path.join(out, "checkpoints")
    # every shard file write is slowed down, so the step-4 save is certainly in flight when we kill
    proc = subprocess.Popen(_cmd(out, "checkpoint.every_steps=2"), env={**ENV, WRITE_DELAY_ENV: "0.2"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        in_flight = lambda: os.path.isdir(os.path.join(ckpt, "2")) and any(
            d.startswith("4.") for d in os.listdir(ckpt))
        _wait_for(in_flight, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert "4" not in os.listdir(ckpt) and os.path.isdir(os.path.join(ckpt, "2", "params"))

    # the restart resumes from step 2; every step from there sleeps 0.5 s (JAXTRON_FAULTS), so the SIGTERM sent
    # once it has logged a step lands seconds before the last step
    rows = _rows(out)
    proc = subprocess.Popen(_cmd(out, "checkpoint.every_steps=2"), env={**ENV, "JAXTRON_FAULTS": "sleep=0.5@step=2"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _rows(out) > rows, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "(step 2)" in stderr and "resumed from" in stderr
    stopped = re.search(rf"^stopped by SIGTERM at step (\d+) of {STEPS}; the next start resumes from there$", stdout,
                        re.M)
    assert stopped and 2 < int(stopped[1]) < STEPS, stdout
    saved = int(stopped[1])
    assert not [d for d in os.listdir(ckpt) if not d.isdigit()]  # the partial save was cleaned up
    assert str(saved) in os.listdir(ckpt)

    proc = _run(out, "checkpoint.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {saved})" in proc.stderr
    assert sorted(int(d) for d in os.listdir(ckpt)) == [STEPS - 2, STEPS]
    assert _losses(out) == reference  # the steps after each restart recomputed, bit for bit

    # the newest checkpoint is damaged: a start (even of the finished run: it reads its newest checkpoint) stops
    # with one error line naming file, step, what is wrong and the way out; told to fall back, it resumes from
    # the previous one and trains the last steps again, bit for bit
    shard = sorted(os.path.join(ckpt, str(STEPS), "params", f) for f in
                   os.listdir(os.path.join(ckpt, str(STEPS), "params")) if f.endswith(".bin"))[0]
    with open(shard, "r+b") as f:
        f.truncate(3)
    proc = _run(out)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and shard in errors[0] and f"step {STEPS}" in errors[0], proc.stderr[-2000:]
    assert "truncated" in errors[0] and "checkpoint.fallback=true" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    proc = _run(out, "checkpoint.fallback=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {STEPS - 2})" in proc.stderr
    assert _losses(out) == reference
