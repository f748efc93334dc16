"""Multi-process training on localhost: 2 processes x 4 CPU devices equal 1 process x 8 devices and stop together
on SIGTERM, the checkpoint they write resumes in 1 process, and a process that is killed (process 0 or 1) or
stopped (process 0, under scripts/launch_local.sh) takes the other down with one error line (no hang)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import TINY, cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = TINY + ["data.max_corpus_bytes=1000000", "data.valid_fraction=0.2", "train.eval_batches=1",
                 "train.eval_every=0", "logging.log_every=1", "parallel.data=2", "parallel.fsdp=2",
                 "parallel.tensor=2", "optim.decay_steps=20",  # a schedule that does not depend on train.steps
                 # one decoder layer: every collective of the layout is still there, and the multi-process runs
                 # (which compile without the persistent cache, see _env) compile in about 3/4 of the time
                 "model.num_layers=1"]


def _env(devices, one_process=False, **extra):
    # No persistent compilation cache for the multi-process runs (conftest sets one): two processes, one of which
    # loads a cached executable and the other compiles it, could not agree on a Gloo context on XLA:CPU (jax
    # 0.10.2: each waited 30 s for the other's key, then failed). A one-process run keeps it: its train step on
    # 8 devices is test_launch's reference's, and the resume below compiles the reference's program again.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JAXTRON_") and (one_process or k != "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices), **extra)
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
                          capture_output=True, text=True, timeout=600, env=_env(devices, one_process=True))


_REFERENCE: dict = {}


def reference_losses(tmp_path_factory) -> dict:
    """step -> loss of the uninterrupted 8-step run on 1 process x 8 devices, without checkpoints: what the
    multi-process runs here and test_launch.py's supervised runs are compared with (the same COMMON). Run once
    per pytest process, whichever of the two files asks first."""
    if not _REFERENCE:
        out = str(tmp_path_factory.mktemp("reference"))
        proc = _train(out, "train.steps=8", "checkpoint.enabled=false")
        assert proc.returncode == 0, proc.stderr[-3000:]
        _REFERENCE.update(_losses(out))
    return dict(_REFERENCE)


def _close(a: dict, b: dict, rtol=1e-5):
    assert sorted(a) == sorted(b)
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]), (step, a[step], b[step])


def _metric_rows(out) -> int:
    metrics = os.path.join(out, "metrics.jsonl")
    return len(open(metrics).read().splitlines()) if os.path.exists(metrics) else 0


def _wait_for_step_2(out, procs) -> None:
    """Until ``out``'s metrics hold step 0's held-out loss and steps 1 and 2, while every process runs."""
    t0 = time.time()
    while _metric_rows(out) < 3:
        assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        assert time.time() - t0 < 300
        time.sleep(0.2)


def test_two_processes_equal_one_stop_on_sigterm_then_resume_in_one(tmp_path, tmp_path_factory):
    """2 processes x 4 devices (scripts/launch_local.sh) train with the losses of 1 process x 8 devices until
    SIGTERM to the script: both processes save at the same step and the script returns 0; 1 process x 8 devices
    resumes that 2-process checkpoint to the uninterrupted run's losses."""
    reference = reference_losses(tmp_path_factory)

    # the same train.steps as the reference: the sample order depends on it (as Megatron's does). Every step
    # from step 2 on sleeps 1 s (JAXTRON_FAULTS), so the SIGTERM sent after step 2 lands seconds before step 8.
    out = str(tmp_path / "multi")
    launch = [os.path.join(REPO, "scripts", "launch_local.sh"), "2", "--", *COMMON, "train.steps=8",
              f"train.output_dir={out}"]
    proc = subprocess.Popen(launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(4, PYTHON=sys.executable, JAXTRON_FAULTS="sleep=1@step=2"))
    try:
        _wait_for_step_2(out, [proc])
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    steps = [int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit()]
    assert len(steps) == 1 and 2 <= steps[0] < 8, steps
    saved = steps[0]
    step_dir = os.path.join(out, "checkpoints", str(saved), "params")
    assert {f for f in os.listdir(step_dir) if f.startswith("index.")} == {"index.p0.json", "index.p1.json"}
    _close(_losses(out), {step: loss for step, loss in reference.items() if step <= saved})
    assert stderr.count("step 0: held-out loss") == 1, stderr[-3000:]  # only process 0 logs
    # only process 0 reports, and XLA:CPU's collectives' "[Gloo]" announcements (from C++) are dropped
    assert stdout.splitlines() == [f"stopped by SIGTERM at step {saved} of 8; the next start resumes from there"]

    proc = _train(out, "train.steps=8")  # 1 process x 8 devices resumes the 2-process checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {saved})" in proc.stderr
    _close(_losses(out), reference)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# train.collective_timeout_s: a stopped peer is named after it, well before JAX's heartbeat timeout (+ 30 s). Not
# less: at 5 s, on a machine loaded 10x over its 2 cores, the watchdog took a slow start-up of the coordination
# service for a lost process 0.
TIMEOUT_S = 8


def _stopped_line(victim: int) -> str:
    return (f"error: process {victim} of 2 stopped answering for {TIMEOUT_S} s (killed, crashed, stopped or its "
            "node lost); exiting")


# A stopped peer (SIGSTOP) is test_launch_local_kills_a_stopped_child's case: it stops process 0, the coordinator
# (its coordination service runs in a process of its own, so stopping process 0 does not stop it). A stopped
# process 1 takes the same watchdog path: the survivor's beat thread sees the peer's counter stand still.
@pytest.mark.parametrize("victim", [1, 0], ids=["SIGKILL-1", "SIGKILL-0"])
def test_a_lost_process_stops_the_other_with_one_error_line(tmp_path, victim):
    """A killed peer (SIGKILL: its connections close, the next collective fails, and the watchdog names the
    process whose beats stopped) ends the survivor with one ``error:`` line, exit status 75, no C++ abort, in
    seconds rather than JAX's heartbeat timeout."""
    out = str(tmp_path / "run")
    port = _free_port()
    procs = []
    for pid in range(2):
        env = _env(4, JAXTRON_COORDINATOR=f"127.0.0.1:{port}", JAXTRON_NUM_PROCESSES="2", JAXTRON_PROCESS_ID=str(pid))
        cmd = [sys.executable, "-m", "jaxtron.train", *COMMON, "train.steps=100000", f"train.output_dir={out}",
               f"train.collective_timeout_s={TIMEOUT_S}", "checkpoint.enabled=false"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        _wait_for_step_2(out, procs)
        procs[victim].send_signal(signal.SIGKILL)
        t_fault = time.time()
        survivor = procs[1 - victim]
        _, stderr = survivor.communicate(timeout=120)
        waited = time.time() - t_fault
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[Gloo]")]
    assert survivor.returncode == 75, stderr[-3000:]
    assert "Check failure" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], stderr[-3000:]
    # the watchdog sees the killed peer's process gone (same machine) at its next beat, or the failed
    # collective reports it first. Process 0's coordination service lives in a process of its own
    # (jaxtron.parallel.coordination_service), so killing process 0 is no C++ abort.
    assert lines[-1] == (f"error: process {victim} of 2 was killed or crashed (its process on this machine is "
                         "gone); exiting") or lines[-1].startswith(
        f"error: process {victim} of 2 was lost (killed or crashed: its heartbeat stopped); process "
        f"{1 - victim}'s collective failed: "), stderr[-3000:]
    assert waited < 15, waited  # JAX's own heartbeat timeout would be TIMEOUT_S + 30 s, then a C++ abort


def _children(pid) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _process_id(pid) -> int:
    """The jaxtron process id of a child of launch_local.sh (from its environment)."""
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(e for e in env if e.startswith(b"JAXTRON_PROCESS_ID=")).split(b"=", 1)[1])


def test_launch_local_kills_a_stopped_child(tmp_path):
    """A stopped child of launch_local.sh, process 0 (the coordinator): the other exits 75 with one ``error:``
    line naming it (the watchdog, after train.collective_timeout_s, not JAX's heartbeat timeout), the script
    SIGKILLs the stopped one after its grace period and returns 75 instead of waiting forever. (SIGTERM to the
    script: test_two_processes_equal_one_stop_on_sigterm_then_resume_in_one.)"""
    out = str(tmp_path / "run")
    cmd = [os.path.join(REPO, "scripts", "launch_local.sh"), "2", "--", *COMMON, "train.steps=100000",
           f"train.collective_timeout_s={TIMEOUT_S}", f"train.output_dir={out}", "checkpoint.enabled=false"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(4, PYTHON=sys.executable, JAXTRON_LAUNCH_GRACE_S="3"))
    children = []
    try:
        _wait_for_step_2(out, [proc])
        children = _children(proc.pid)
        assert len(children) == 2, children
        children.sort(key=_process_id)
        os.kill(children[0], signal.SIGSTOP)
        t0 = time.time()
        _, stderr = proc.communicate(timeout=120)
        waited = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 75, stderr[-3000:]
    assert "stopping the others" in stderr and waited < 60, (waited, stderr[-3000:])
    # the lines of both processes (process 0's up to its stop: it says nothing more), less the script's own and
    # bash's note on the job it killed ("/path/launch_local.sh: line 57:  1234 Killed  ...")
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[Gloo]")
             and not line.split(" ", 1)[0].endswith("launch_local.sh:")]
    assert "Check failure" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in lines if line.startswith("error:")] == [_stopped_line(0)], stderr[-3000:]
    assert lines[-1] == _stopped_line(0), stderr[-3000:]
    assert all(subprocess.run(["ps", "-p", str(c), "-o", "stat="], capture_output=True, text=True).stdout.strip()
               in ("", "Z") for c in children)


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


def test_gloo_banners_and_their_stray_newlines_are_dropped_from_stdout():
    """Two communicators' banners interleaved mid-line leave one line with both and the second newline alone
    (seen as a blank first line of a run's stdout); both go, the run's own lines, blank ones included, stay,
    split over reads anywhere."""
    from jaxtron.parallel.distributed import GlooBannerFilter

    banner = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    stream = banner[:30] + banner + banner[30:] + b"\n\nstopped by SIGTERM at step 3\n\nresumes\n" + banner + b"\n"
    for cut in (1, 7, 64, len(stream)):
        f = GlooBannerFilter()
        out = b"".join(f.feed(stream[i:i + cut]) for i in range(0, len(stream), cut)) + f.end()
        assert out == b"stopped by SIGTERM at step 3\n\nresumes\n", (cut, out)
