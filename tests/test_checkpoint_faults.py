"""Fault tolerance of real ``python -m jaxtron.train`` processes: SIGKILL in the middle of an asynchronous save,
SIGTERM (save and exit cleanly), and an unreadable newest checkpoint. After each, the restarted run's losses
equal an uninterrupted run's, bit for bit."""

import json
import os
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


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path, reference):
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

    proc = _run(out, "checkpoint.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 2)" in proc.stderr and "resumed from" in proc.stderr
    assert not [d for d in os.listdir(ckpt) if not d.isdigit()]  # the partial save was cleaned up
    assert sorted(int(d) for d in os.listdir(ckpt)) == [STEPS - 2, STEPS]
    assert _losses(out) == reference  # steps 3.. recomputed after the restart, bit for bit

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


def test_sigterm_saves_and_exits_cleanly_then_resumes(tmp_path, reference):
    out = str(tmp_path / "run")
    # every step from step 2 on sleeps 0.5 s (JAXTRON_FAULTS), so the SIGTERM sent after step 2 lands seconds
    # before the last step
    proc = subprocess.Popen(_cmd(out), env={**ENV, "JAXTRON_FAULTS": "sleep=0.5@step=2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_losses(out)) >= 2, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout
    steps = [int(d) for d in os.listdir(os.path.join(out, "checkpoints"))]
    assert len(steps) == 1 and 2 <= steps[0] < STEPS
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {steps[0]})" in proc.stderr
    assert _losses(out) == reference
