"""The supervisor (python -m jaxtron.launch) under injected faults, on CPU with 2 processes x 4 devices: a killed
coordinator and a crash are restarted from the newest checkpoint (the first on one process fewer, the mesh
re-laid); two supervisors started as JobSet pods with only the pods' environment join one run, name a
straggler, end a hang and restart together. Every run ends with the uninterrupted run's losses and consumed
samples. Also the re-layout arithmetic and the supervisor's one-line errors."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

import test_multihost
from helpers import cpu_xla_flags

from jaxtron import config as config_lib

# test_multihost's runs (one decoder layer, data 2 x fsdp 2 x tensor 2), 8 steps: its uninterrupted 1-process run
# is the reference here too
COMMON = test_multihost.COMMON + ["train.steps=8"]
STEPS, GLOBAL_BATCH = 8, 8


def _env(**extra):
    # no persistent compilation cache for multi-process runs (see test_multihost._env)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRON_") and k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", **extra)
    env["XLA_FLAGS"] = cpu_xla_flags(1).split(" ", 1)[1]  # the fast-compile flags; the supervisor adds devices
    return env


def _rows(out, name="metrics.jsonl"):
    return [json.loads(line) for line in open(os.path.join(out, name)).read().splitlines()]


def _losses(out) -> dict:
    return {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}


def _close(a: dict, b: dict, rtol: float):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]), (step, a[step], b[step])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: one process, the same 8-device mesh (shared with test_multihost.py)."""
    return test_multihost.reference_losses(tmp_path_factory)


def _supervise(out, faults, *launch_args, extra=()):
    cmd = [sys.executable, "-m", "jaxtron.launch", "--processes", "2", "--cpu-devices", "4", "--backoff", "0.2",
           "--grace", "10", *launch_args, "--", *COMMON, f"train.output_dir={out}", "checkpoint.every_steps=2",
           "train.collective_timeout_s=10", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(JAXTRON_FAULTS=faults))


def _supervisor_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith(("launch:", "error: launch:"))]


def test_killed_coordinator_shrinks_then_a_crash_restarts_in_place(tmp_path, reference):
    """Attempt 0: process 0 (the coordinator) is SIGKILLed after step 3: its slot is lost, and the run restarts
    on 1 process x 4 devices (data 2 -> 1, accumulation 1 -> 2, global batch 8). Attempt 1: that process
    crashes after step 6 and is restarted in place. The losses are the uninterrupted run's (reassociation
    tolerance) and every sample is consumed once."""
    out = str(tmp_path / "run")
    proc = _supervise(out, "kill@step=3,process=0,attempt=0;exit@step=6,process=0,attempt=1", "--min-processes", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = _rows(out, "launch.jsonl")
    failures = [e for e in events if "failure" in e]
    assert len(failures) == 2, _supervisor_lines(proc.stderr)
    assert "process 0" in failures[0]["failure"] and "SIGKILL" in failures[0]["failure"]
    assert failures[0]["lost_slots"] == [0]
    assert failures[1]["status"] == 1 and "injected fault" in failures[1]["failure"]
    shrink = next(e for e in events if "shrink_to" in e)
    assert shrink["shrink_to"] == 1 and shrink["micro_batch_size"] == 2 and shrink["accumulation"] == 2
    assert (shrink["layout"]["data"], shrink["layout"]["fsdp"], shrink["layout"]["tensor"]) == (1, 2, 2)
    starts = [e for e in events if "processes" in e]
    assert [e["processes"] for e in starts] == [2, 1, 1]
    assert starts[1]["overrides"] == starts[2]["overrides"] == ["parallel.data=1", "parallel.fsdp=2",
                                                                 "train.micro_batch_size=2"]
    assert events[-1].get("end") and events[-1]["status"] == 0
    _close(_losses(out), reference, rtol=1e-5)
    last = [r for r in _rows(out) if "consumed_samples" in r][-1]
    assert (last["step"], last["consumed_samples"]) == (STEPS, STEPS * GLOBAL_BATCH)
    lines = _supervisor_lines(proc.stderr)
    assert all("Traceback" not in line for line in lines)
    assert any(line.startswith("launch: shrinking: slot(s) 0 lost; 2 -> 1 process(es)") for line in lines), lines


def pod_env(job, jobs=2, **extra):
    """What a JobSet pod's environment holds (the manifest's downward-API variables and Kubernetes' own)."""
    return {"JOBSET_NAME": "jx", "REPLICATED_JOB_NAME": "worker", "REPLICATED_JOB_REPLICAS": str(jobs),
            "JOB_INDEX": str(job), "JOB_COMPLETION_INDEX": "0", **extra}


def test_two_jobset_pods_name_a_straggler_end_a_hang_and_restart_together(tmp_path, reference):
    """Two supervisors as the two pods of a JobSet, started with only the JobSet environment (the coordinator
    annotation names this machine): each finds its rank and the coordinator from it, and so does the one
    training process each starts, and the two join one run. Process 1 sleeps 1 s after every step from step 2
    (a straggler: named in the log and metrics.jsonl), then hangs after step 5: the hang detector ends the run
    within its limit (4 x the median step, at least 3 s), naming the step, and both supervisors restart their
    pods together (the next attempt's port) to the uninterrupted run's losses."""
    out = str(tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    faults = "sleep=1@step=2,process=1,attempt=0;hang@step=5,process=1,attempt=0"
    procs = []
    for job in range(2):
        env = _env(JAXTRON_FAULTS=faults, **pod_env(job, JOBSET_COORDINATOR="127.0.0.1",
                                                    JAXTRON_COORDINATOR_PORT=str(port)))
        cmd = [sys.executable, "-m", "jaxtron.launch", "--processes", "1", "--cpu-devices", "4", "--backoff", "0.2",
               "--", *COMMON, f"train.output_dir={out}", "checkpoint.every_steps=2", "train.collective_timeout_s=10",
               "monitor.hang_factor=4", "monitor.hang_min_s=3", "monitor.straggler_threshold=1.3"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        stderr = [p.communicate(timeout=900)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, stderr):
        assert p.returncode == 0, err[-4000:]
    assert "on node 1 of 2" in stderr[1] and "on 8 devices" in stderr[0]  # one mesh over both pods
    # 1 s late on steps of 1-2.5 s (the sleep included): about 1.4-2x
    assert re.search(r"straggler at step [34]: process 1 is", stderr[0]), stderr[0][-4000:]
    rows = {r["step"]: r for r in _rows(out) if "straggler_process" in r}
    for step in (3, 4):
        assert rows[step]["straggler_process"] == 1 and rows[step]["straggler_slowdown"] > 1.3, rows.get(step)
        assert rows[step]["stragglers"].startswith("process 1 ")
    events = _rows(out, "launch.jsonl")  # node 0's
    failure = next(e for e in events if "failure" in e)
    assert "step 6 hung on process" in failure["failure"] and failure["status"] == 75, failure
    assert "behind: process 1" in failure["failure"] or "hung on process 1" in failure["failure"], failure
    quiet, limit = map(int, re.search(r"no progress for (\d+) s \(limit (\d+) s", failure["failure"]).groups())
    assert limit <= quiet <= limit + 2, failure  # the detector looks twice a second
    step4 = [r["time"] for r in _rows(out, "health.jsonl") if r["step"] == 4][0]
    assert failure["time"] - step4 < limit + 20, failure["time"] - step4  # step 5, the limit, stopping
    assert [e["processes"] for e in events if "processes" in e] == [1, 1]
    assert "launch: attempt 1: starting 1 process(es) on node 1 of 2" in stderr[1]
    _close(_losses(out), reference, rtol=1e-5)


# ------------------------------------------------------------------------------------------- no processes


def _cfg(*extra):
    return config_lib.load(None, COMMON + list(extra))


def test_shrink_keeps_the_global_batch_and_grows_accumulation():
    from jaxtron.parallel import elastic

    cfg = _cfg()
    new = elastic.shrink(cfg, 8, 4)
    assert (new.sizes["data"], new.sizes["fsdp"], new.sizes["tensor"]) == (1, 2, 2)
    assert (new.micro_batch_size, new.accumulation) == (2, 2)
    new = elastic.shrink(cfg, 8, 2)  # fsdp shrinks once data is 1
    assert (new.sizes["data"], new.sizes["fsdp"], new.micro_batch_size, new.accumulation) == (1, 1, 2, 4)
    with pytest.raises(config_lib.ConfigError, match="parallel: cannot re-lay the mesh on 3 devices"):
        elastic.shrink(cfg, 8, 3)
    assert elastic.largest_fit(cfg, 8, 1, at_most=7, at_least=1) == 4
    cfg = _cfg("parallel.data=4", "parallel.fsdp=1", "train.micro_batch_size=1", "train.global_batch_size=12")
    assert elastic.current(cfg, 8).accumulation == 3  # 12 = micro batch 1 x data 4 x 3 (tensor 2)
    new = elastic.shrink(cfg, 8, 6)
    assert (new.sizes["data"], new.micro_batch_size, new.accumulation) == (3, 1, 4)


@pytest.mark.parametrize("args,message", [
    (["--min-processes", "3", "--processes", "2"], "--min-processes 3 is more than --processes 2"),
    (["--nodes", "2"], "--nodes > 1 needs --coordinator"),
    (["--nodes", "2", "--node-rank", "2", "--coordinator", "h:1"], "--node-rank 2 is not in 0..1"),
    (["--processes", "2", "--cpu-devices", "4", "--", "parallel.tensor=3"], "parallel.data: cannot fill"),
    (["--", "train.stepz=3"], "train.stepz: unknown field"),
])
def test_supervisor_usage_errors_are_one_line(args, message, monkeypatch, capsys):
    """In this process: main() is what ``python -m jaxtron.launch`` runs (an exception would fail the test), without
    a Python start-up per case."""
    from jaxtron.launch.__main__ import main

    for name in [k for k in os.environ if k.startswith("JAXTRON_")]:  # as in _env()
        monkeypatch.delenv(name)
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: launch: ") and message in lines[-1], err


def test_fault_specs():
    from jaxtron.train import faults

    fs = faults.parse("kill@step=3,process=0; sleep=0.5@process=1 ;hang@step=2,attempt=1")
    assert [(f.action, f.value, f.step, f.process, f.attempt) for f in fs] == [
        ("kill", 0.0, 3, 0, 0), ("sleep", 0.5, 1, 1, 0), ("hang", 0.0, 2, None, 1)]
    for bad, why in [("explode@step=1", "unknown action"), ("kill@stp=1", "unknown key"),
                     ("kill@step=x", "invalid literal")]:
        with pytest.raises(config_lib.ConfigError, match=f"JAXTRON_FAULTS: '{bad}': {why}"):
            faults.parse(bad)
