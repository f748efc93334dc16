"""``python -m jaxtron.launch k8s``: a Kubernetes JobSet manifest for N nodes x G GPUs, the supervisor inside.

One replicated job ``worker`` with one Job (one pod) per node; each pod asks for G GPUs and runs
``python -m jaxtron.launch`` (the supervisor), which finds its node rank, the number of nodes and the
coordinator from the environment the manifest gives it (:mod:`jaxtron.parallel.kubernetes`: the JobSet's
annotations through the downward API, ``spec.coordinator`` for the coordinator pod's DNS name in the JobSet's
headless service) and restarts the training processes of its pod when any process of the run fails. The
checkpoint volume (a ReadWriteMany PersistentVolumeClaim) is mounted in every pod, and ``train.output_dir``
points into it, so a restart (the supervisor's, or JobSet's ``failurePolicy`` recreating every pod when a node
is lost) resumes from the newest checkpoint.

    python -m jaxtron.launch k8s --name llama8b --nodes 4 --gpus-per-node 8 --image REGISTRY/jaxtron:TAG \\
        --checkpoint-volume jaxtron-checkpoints -- --config configs/llama3_8b.yaml parallel.fsdp=32 > jobset.yaml
    kubectl apply -f jobset.yaml
"""

from __future__ import annotations

import argparse
import re
import sys

import yaml

from jaxtron.parallel.kubernetes import DEFAULT_PORT

REPLICATED_JOB = "worker"
# the pod's environment (jaxtron.parallel.kubernetes) from the JobSet's annotations
ANNOTATION_ENV = {
    "JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
    "REPLICATED_JOB_NAME": "jobset.sigs.k8s.io/replicatedjob-name",
    "REPLICATED_JOB_REPLICAS": "jobset.sigs.k8s.io/replicatedjob-replicas",
    "JOB_INDEX": "jobset.sigs.k8s.io/job-index",
    "JOBSET_COORDINATOR": "jobset.sigs.k8s.io/coordinator",
}
NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def manifest(name: str, nodes: int, gpus_per_node: int, image: str, checkpoint_volume: str, train_args: list,
             mount: str = "/checkpoints", port: int = DEFAULT_PORT, max_restarts: int = 3,
             jobset_restarts: int = 2, namespace: str = None, cpu_devices: int = None) -> dict:
    """The JobSet as a dict (``yaml.safe_dump`` it). ``cpu_devices`` instead of GPUs: a CPU-only cluster."""
    env = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{a}']"}}}
           for k, a in ANNOTATION_ENV.items()]
    env += [{"name": "PODS_PER_JOB", "value": "1"}, {"name": "JAXTRON_COORDINATOR_PORT", "value": str(port)},
            {"name": "PYTHONUNBUFFERED", "value": "1"}]
    command = ["python", "-m", "jaxtron.launch", "--max-restarts", str(max_restarts)]
    resources = {}
    if cpu_devices:
        command += ["--cpu-devices", str(cpu_devices)]
    else:
        resources = {"limits": {"nvidia.com/gpu": gpus_per_node}}
    command += ["--", *train_args, f"train.output_dir={mount}/{name}"]
    container = {
        "name": "jaxtron", "image": image, "command": command, "env": env,
        # informational (pods reach each other without it); attempt k of the supervisor serves on port + k
        "ports": [{"name": "coordinator", "containerPort": port, "protocol": "TCP"}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": mount}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if resources:
        container["resources"] = resources
    pod_spec = {
        "restartPolicy": "Never",  # the supervisor restarts processes; JobSet recreates lost pods
        "terminationGracePeriodSeconds": 180,  # SIGTERM: every process saves a checkpoint, then exits
        "containers": [container],
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_volume}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    metadata = {"name": name, "labels": {"app.kubernetes.io/name": "jaxtron"}}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            # a failed pod (its node lost, or the supervisor out of restarts) recreates every pod, this many times
            "failurePolicy": {"maxRestarts": jobset_restarts},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "coordinator": {"replicatedJob": REPLICATED_JOB, "jobIndex": 0, "podIndex": 0},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": nodes,
                "template": {"spec": {
                    "parallelism": 1, "completions": 1, "completionMode": "Indexed", "backoffLimit": 0,
                    "template": {"metadata": {"labels": {"app.kubernetes.io/name": "jaxtron"}}, "spec": pod_spec},
                }},
            }],
        },
    }


def main(argv: list) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxtron.launch k8s", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="jaxtron", help="the JobSet's name (a DNS label; default jaxtron)")
    p.add_argument("--nodes", type=int, required=True, help="nodes (pods), one Job each")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs each pod asks for (default 8)")
    p.add_argument("--cpu-devices", type=int, default=None, help="no GPUs: this many virtual CPU devices per pod")
    p.add_argument("--image", required=True, help="a container image with jaxtron installed")
    p.add_argument("--checkpoint-volume", required=True,
                   help="a ReadWriteMany PersistentVolumeClaim every pod mounts for checkpoints and metrics")
    p.add_argument("--mount", default="/checkpoints", help="where it is mounted (default /checkpoints)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"coordinator port (default {DEFAULT_PORT})")
    p.add_argument("--max-restarts", type=int, default=3, help="the supervisor's restart budget (default 3)")
    p.add_argument("--jobset-restarts", type=int, default=2,
                   help="JobSet failurePolicy.maxRestarts: recreations of every pod (default 2)")
    p.add_argument("--namespace", default=None)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then python -m jaxtron.train arguments")
    a = p.parse_args(argv)
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args

    def bad(message: str) -> int:
        print(f"error: launch k8s: {message}", file=sys.stderr)
        return 2

    # pod hostnames <name>-worker-<job>-0 must be DNS labels of at most 63 characters
    longest = f"{a.name}-{REPLICATED_JOB}-{max(a.nodes - 1, 0)}-0"
    if not NAME.match(a.name) or len(longest) > 63:
        return bad(f"--name {a.name!r}: lower-case letters, digits and '-', starting with a letter, and short "
                   f"enough that {longest!r} has at most 63 characters")
    for flag, value in (("--nodes", a.nodes), ("--gpus-per-node", a.gpus_per_node), ("--port", a.port)):
        if value < 1:
            return bad(f"{flag} must be >= 1, got {value}")
    if a.port + a.max_restarts > 65535:
        return bad(f"--port {a.port} + --max-restarts {a.max_restarts} passes 65535")
    if a.max_restarts < 0 or a.jobset_restarts < 0:
        return bad("--max-restarts and --jobset-restarts must be >= 0")
    if any(arg.startswith("train.output_dir=") for arg in train_args):
        return bad(f"train.output_dir is set by the manifest ({a.mount}/{a.name}, on the checkpoint volume)")
    doc = manifest(a.name, a.nodes, a.gpus_per_node, a.image, a.checkpoint_volume, train_args, a.mount, a.port,
                   a.max_restarts, a.jobset_restarts, a.namespace, a.cpu_devices)
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False))
    return 0
