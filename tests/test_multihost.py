"""Multi-process training on localhost: 2 processes x 4 CPU devices equal 1 process x 8 devices, the checkpoint
they write resumes in 1 process, and a process that dies takes the other down with an error (no hang)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = TINY + ["data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1",
                 "train.eval_every=0", "logging.log_every=1", "parallel.data=2", "parallel.fsdp=2",
                 "parallel.tensor=2", "optim.decay_steps=20"]  # a schedule that does not depend on train.steps


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRON_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)
    return env


def _losses(out) -> dict:
    losses = {}
    for line in open(os.path.join(out, "metrics.jsonl")).read().splitlines():
        r = json.loads(line)
        if "loss" in r:
            losses[r["step"]] = r["loss"]
    return losses


def _train(out, *extra, devices=8):
    return subprocess.run([sys.executable, "-m", "jaxtron.train", *COMMON, f"train.output_dir={out}", *extra],
                          capture_output=True, text=True, timeout=600, env=_env(devices))


def _close(a: dict, b: dict, rtol=1e-5):
    assert sorted(a) == sorted(b)
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]), (step, a[step], b[step])


def test_two_processes_equal_one_then_resume_in_one(tmp_path):
    ref = str(tmp_path / "ref")
    proc = _train(ref, "train.steps=8", "checkpoint.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _losses(ref)

    # the same train.steps as the reference: the sample order depends on it (as Megatron's does)
    out = str(tmp_path / "multi")
    launch = [os.path.join(REPO, "scripts", "launch_local.sh"), "2", "--", *COMMON, "train.steps=8",
              "checkpoint.every_steps=5", f"train.output_dir={out}"]
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=_env(4, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-4000:]
    _close(_losses(out), reference)
    step_dir = os.path.join(out, "checkpoints", "5", "params")
    assert {f for f in os.listdir(step_dir) if f.startswith("index.")} == {"index.p0.json", "index.p1.json"}
    assert proc.stdout.count("held-out loss") == 1  # only process 0 reports

    shutil.rmtree(os.path.join(out, "checkpoints", "8"))  # as if the 2-process job had died after step 5
    proc = _train(out, "train.steps=8")  # 1 process x 8 devices resumes the 2-process checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 5)" in proc.stderr
    _close(_losses(out), reference)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_process_stops_the_other_with_an_error(tmp_path):
    out = str(tmp_path / "run")
    port = _free_port()
    procs = []
    for pid in range(2):
        env = _env(4, JAXTRON_COORDINATOR=f"127.0.0.1:{port}", JAXTRON_NUM_PROCESSES="2", JAXTRON_PROCESS_ID=str(pid))
        cmd = [sys.executable, "-m", "jaxtron.train", *COMMON, "train.steps=100000", f"train.output_dir={out}",
               "train.collective_timeout_s=10", "checkpoint.enabled=false"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        metrics = os.path.join(out, "metrics.jsonl")
        t0 = time.time()
        while not (os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 3):
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
            assert time.time() - t0 < 300
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        t_kill = time.time()
        _, stderr = procs[0].communicate(timeout=120)
        waited = time.time() - t_kill
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0 and waited < 120
    # JAX's distributed service names the lost process ("Task 1 heartbeat timeout" or "tasks are unhealthy
    # (stopped sending heartbeats): 1", depending on which side notices first)
    assert "another task died" in stderr, stderr[-3000:]
    assert re.search(r"Task 1\b|stopped sending heartbeats\):\s*1\b", stderr), stderr[-3000:]


@pytest.mark.parametrize("env,field", [
    ({"JAXTRON_COORDINATOR": "127.0.0.1:1234"}, "distributed"),
    ({"JAXTRON_COORDINATOR": "127.0.0.1:1234", "JAXTRON_NUM_PROCESSES": "2", "JAXTRON_PROCESS_ID": "2"},
     "distributed.process_id"),
    ({"JAXTRON_COORDINATOR": "nohostport", "JAXTRON_NUM_PROCESSES": "2", "JAXTRON_PROCESS_ID": "0"},
     "distributed.coordinator"),
])
def test_bad_distributed_settings(monkeypatch, capsys, env, field):
    from jaxtron.train.__main__ import main
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(TINY) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {field}")
