"""A pod of a Kubernetes JobSet: where the coordinator is and which process this is, from the environment.

JobSet (jobset.x-k8s.io/v1alpha2) makes ``replicas`` Jobs from a replicated job; each pod of Job ``j`` gets the
annotations ``jobset.sigs.k8s.io/jobset-name``, ``.../replicatedjob-name``, ``.../replicatedjob-replicas`` and
``.../job-index`` (= j), Kubernetes sets ``JOB_COMPLETION_INDEX`` (the pod's index in its Indexed Job), and
with ``spec.coordinator`` every pod also carries ``jobset.sigs.k8s.io/coordinator``, the stable DNS name of the
coordinator pod. The manifest of ``python -m jaxtron.launch k8s`` passes them in as environment variables
(the downward API):

=========================  =====================================================  ===========================
variable                   from                                                   meaning
=========================  =====================================================  ===========================
``JOBSET_NAME``            annotation ``jobset.sigs.k8s.io/jobset-name``          the JobSet
``REPLICATED_JOB_NAME``    annotation ``jobset.sigs.k8s.io/replicatedjob-name``   the replicated job
``REPLICATED_JOB_REPLICAS`` annotation ``jobset.sigs.k8s.io/replicatedjob-replicas``  Jobs (nodes)
``JOB_INDEX``              annotation ``jobset.sigs.k8s.io/job-index``            this Job's index
``JOB_COMPLETION_INDEX``   Kubernetes (Indexed Jobs)                              the pod's index in its Job
``JOBSET_COORDINATOR``     annotation ``jobset.sigs.k8s.io/coordinator``          coordinator pod's DNS name
``PODS_PER_JOB``           the manifest (default 1)                               pods in each Job
``JAXTRON_COORDINATOR_PORT`` the manifest (default 8476)                          the coordinator's port
=========================  =====================================================  ===========================

A pod is process ``JOB_INDEX * PODS_PER_JOB + JOB_COMPLETION_INDEX`` of ``REPLICATED_JOB_REPLICAS *
PODS_PER_JOB``. Without ``JOBSET_COORDINATOR`` the coordinator is pod 0 of Job 0 by JobSet's naming convention:
``<jobset>-<replicated job>-0-0.<subdomain>`` (the subdomain, the JobSet's headless service, defaults to the
JobSet's name; ``JOBSET_SUBDOMAIN`` overrides it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from jaxtron.config import ConfigError

REQUIRED = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "REPLICATED_JOB_REPLICAS", "JOB_INDEX", "JOB_COMPLETION_INDEX")
DEFAULT_PORT = 8476


@dataclass(frozen=True)
class JobSetPod:
    coordinator: str  # host:port
    num_pods: int
    pod_rank: int


def detected(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a JobSet pod whose manifest passes the variables above."""
    return all(env.get(k) for k in ("JOBSET_NAME", "JOB_COMPLETION_INDEX"))


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = env.get(name)
    if not value:
        if default is not None:
            return default
        raise ConfigError("distributed", f"a Kubernetes JobSet pod needs {name} in its environment (set from the "
                                         "JobSet's annotations by the manifest: python -m jaxtron.launch k8s)")
    try:
        return int(value)
    except ValueError:
        raise ConfigError("distributed", f"{name} must be an integer, got {value!r}") from None


def pod(env: Mapping[str, str] = os.environ) -> JobSetPod:
    """This pod's place in the JobSet (ConfigError naming a missing or bad variable)."""
    jobs, job = _int(env, "REPLICATED_JOB_REPLICAS"), _int(env, "JOB_INDEX")
    per_job, index = _int(env, "PODS_PER_JOB", 1), _int(env, "JOB_COMPLETION_INDEX")
    port = _int(env, "JAXTRON_COORDINATOR_PORT", DEFAULT_PORT)
    name, rjob = env.get("JOBSET_NAME", ""), env.get("REPLICATED_JOB_NAME", "")
    if not rjob:
        raise ConfigError("distributed", "a Kubernetes JobSet pod needs REPLICATED_JOB_NAME in its environment")
    if not (0 <= job < jobs and 0 <= index < per_job):
        raise ConfigError("distributed", f"JOB_INDEX={job} / JOB_COMPLETION_INDEX={index} are outside the JobSet's "
                                         f"{jobs} Jobs x {per_job} pods (REPLICATED_JOB_REPLICAS, PODS_PER_JOB)")
    host = env.get("JOBSET_COORDINATOR") or f"{name}-{rjob}-0-0.{env.get('JOBSET_SUBDOMAIN') or name}"
    return JobSetPod(f"{host}:{port}", jobs * per_job, job * per_job + index)
