"""Kubernetes: the JobSet manifest (valid YAML, the fields the JobSet CRD v1alpha2 requires, the pod's
environment from JobSet's annotations, the supervisor inside) and a pod's place from that environment.
tests/test_launch.py starts two pods' supervisors with only that environment."""

import subprocess
import sys

import pytest
import yaml

from jaxtron import config as config_lib
from jaxtron.launch import k8s
from jaxtron.parallel import kubernetes

from test_launch import pod_env



def _generate(*args):
    return subprocess.run([sys.executable, "-m", "jaxtron.launch", "k8s", *args], capture_output=True, text=True,
                          timeout=120)


def test_manifest_is_a_jobset_with_the_supervisor_inside():
    proc = _generate("--name", "llama", "--nodes", "4", "--gpus-per-node", "8", "--image", "reg/jaxtron:1",
                     "--checkpoint-volume", "ckpt", "--", "--config", "tiny", "parallel.fsdp=32")
    assert proc.returncode == 0, proc.stderr
    doc = yaml.safe_load(proc.stdout)
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet", "llama")
    spec = doc["spec"]
    # required by the CRD's schema: replicatedJobs[].name and template.spec.template; coordinator.replicatedJob
    rj = spec["replicatedJobs"][0]
    assert rj["name"] == spec["coordinator"]["replicatedJob"] == "worker" and rj["replicas"] == 4
    job = rj["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (1, 1, "Indexed", 0)
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == "reg/jaxtron:1" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["command"][:3] == ["python", "-m", "jaxtron.launch"]
    assert c["command"][c["command"].index("--") + 1:] == ["--config", "tiny", "parallel.fsdp=32",
                                                          "train.output_dir=/checkpoints/llama"]
    env = {e["name"]: e for e in c["env"]}
    for name, annotation in k8s.ANNOTATION_ENV.items():
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{annotation}']"
    assert set(kubernetes.REQUIRED) - {"JOB_COMPLETION_INDEX"} <= set(env)  # Kubernetes sets that one itself
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["checkpoints"] == "/checkpoints"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "ckpt"
    assert set(mounts) == set(volumes)


@pytest.mark.parametrize("args,message", [
    (["--nodes", "2", "--image", "i", "--checkpoint-volume", "c", "--name", "Bad_Name"], "--name 'Bad_Name'"),
    (["--nodes", "0", "--image", "i", "--checkpoint-volume", "c"], "--nodes must be >= 1"),
    (["--nodes", "2", "--image", "i", "--checkpoint-volume", "c", "--", "train.output_dir=x"], "train.output_dir"),
])
def test_manifest_errors_are_one_line(args, message, capsys):
    """In this process: main() is what ``python -m jaxtron.launch k8s`` runs (the manifest test above runs that
    command), without a Python start-up per case."""
    from jaxtron.launch.__main__ import main

    try:
        status = main(["k8s", *args])
    except SystemExit as stop:  # argparse's own exit, as the command would end
        status = stop.code
    captured = capsys.readouterr()
    assert status == 2 and captured.err.startswith("error: launch k8s: ") and message in captured.err, captured
    assert len(captured.err.strip().splitlines()) == 1 and not captured.out


def _pod_env(job, jobs=2, **extra):
    return pod_env(job, jobs, **extra)


def test_a_pods_place_from_its_environment():
    p = kubernetes.pod(_pod_env(1, jobs=4))
    assert (p.coordinator, p.num_pods, p.pod_rank) == ("jx-worker-0-0.jx:8476", 4, 1)
    p = kubernetes.pod(_pod_env(1, 2, PODS_PER_JOB="2", JOB_COMPLETION_INDEX="1", JOBSET_COORDINATOR="c.jx",
                                JAXTRON_COORDINATOR_PORT="9000"))
    assert (p.coordinator, p.num_pods, p.pod_rank) == ("c.jx:9000", 4, 3)
    assert not kubernetes.detected({"JOB_COMPLETION_INDEX": "0"})  # a plain Indexed Job is not a JobSet
    with pytest.raises(config_lib.ConfigError, match="REPLICATED_JOB_REPLICAS"):
        kubernetes.pod({"JOBSET_NAME": "jx", "JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(config_lib.ConfigError, match="outside the JobSet's 2 Jobs"):
        kubernetes.pod(_pod_env(2))
