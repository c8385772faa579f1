"""The pure builder of a pool whose replicas span nodes: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, the
Kubernetes SIG's group API that KServe, llm-d and Dynamo build on) instead of a Deployment.

One group per replica, `size` pods per group, one pipeline stage per pod (profiles.py decides the layout):
- every pod runs the same `hpi serve` command line (manifests.py); LWS tells each its place through
  LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX, which the runtime reads as its multi-node flags;
- the leader (index 0) serves the API, runs the scheduler and stage 0: it alone carries the selector label, so
  only leaders are behind the Service, the router, the InferencePool, the PDB and the autoscaler's scrapes, and
  it alone has the startup, liveness and readiness probes;
- workers run their stage only. They have no probes: the leader watches them (a dead or stalled worker fails
  the leader's requests and health, and the leader exits), and `RecreateGroupOnPodRestart` restarts the group
  as a whole when any pod restarts;
- every pod gets the stage split the operator sized each stage's memory for (profile.layer_partition) as
  `VLLM_PP_LAYER_PARTITION`, so the runtime loads exactly those layers;
- `startupPolicy: LeaderCreated`: workers start with the leader, which waits for them (LeaderReady would wait
  for a leader that is only ready once its workers have joined);
- a pool setting `topologyKey` (spec.placement.pools[]) adds LWS's exclusive-topology annotation: one group per
  topology domain (a rack, a block), so a group's link stays inside it.

Scaling: the operator writes `spec.replicas` (groups) as it does a Deployment's; LWS's scale subresource shows
it to `kubectl scale` and HPAs. Without LWS installed, applying answers 404: reconcile.py reports it as a
condition and an Event and keeps the other pools serving.
"""

from __future__ import annotations

import copy
from typing import Any

from hpi_contracts.pipeline_split import PP_LAYER_PARTITION_ENV, format_partition

from .manifests import Owner, deployment_name, pod_template, short_name
from .names import LABEL_COMPONENT, LABEL_DEPLOYMENT, LABEL_GROUP_MEMBER
from .nodes import Pool
from .profiles import Profile
from .spec import InferenceSpec

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "leaderworkerset.sigs.k8s.io/exclusive-topology"
WORKER_COMPONENT = "inference-worker"
_LEADER_ONLY = ("startupProbe", "livenessProbe", "readinessProbe", "lifecycle")


def group_labels(owner_name: str) -> dict[str, str]:
    return {LABEL_GROUP_MEMBER: short_name(owner_name)}


def _worker_template(leader: dict[str, Any]) -> dict[str, Any]:
    worker = copy.deepcopy(leader)
    labels = worker["metadata"]["labels"]
    labels.pop(LABEL_DEPLOYMENT)  # not selected by the Service, the PDB or the scrapes: workers serve nobody
    labels[LABEL_COMPONENT] = WORKER_COMPONENT
    pod_spec = worker["spec"]
    pod_spec.pop("topologySpreadConstraints", None)  # the leader's selector; the group's pods land where LWS puts them
    for container in pod_spec["containers"]:
        for key in _LEADER_ONLY:
            container.pop(key, None)
    return worker


def _pin_layer_partition(template: dict[str, Any], profile: Profile) -> None:
    """Every pod loads the layers the operator sized its memory for: the split travels as the runtime's
    $VLLM_PP_LAYER_PARTITION, unless spec.runtime.env sets it (the user's split wins)."""
    for container in template["spec"]["containers"]:
        env = container.setdefault("env", [])
        if profile.layer_partition and all(e["name"] != PP_LAYER_PARTITION_ENV for e in env):
            value = format_partition(profile.layer_partition)
            container["env"] = [*env, {"name": PP_LAYER_PARTITION_ENV, "value": value}]


def build_leaderworkerset(
    owner: Owner, spec: InferenceSpec, pool: Pool, profile: Profile, replicas: int, cached_dir: str | None = None,
    pool_profile_configmap: str | None = None,
) -> dict[str, Any]:
    """The LeaderWorkerSet that runs `replicas` groups of `profile.num_nodes` pods on `pool`."""
    leader = pod_template(owner, spec, pool, profile, cached_dir, pool_profile_configmap)
    leader["metadata"]["labels"].update(group_labels(owner.name))
    _pin_layer_partition(leader, profile)
    worker = _worker_template(leader)
    annotations: dict[str, str] = {}
    topology_key = spec.placement.pool(pool.name).topology_key
    if topology_key:
        annotations[EXCLUSIVE_TOPOLOGY_ANNOTATION] = topology_key
    labels = {k: v for k, v in leader["metadata"]["labels"].items() if k != LABEL_GROUP_MEMBER}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {
            "name": deployment_name(owner.name, pool.name),
            "namespace": owner.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            # One group at a time, never a surge group: a group is several nodes' worth of accelerators.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},  # fmt: skip
            "leaderWorkerTemplate": {
                "size": profile.num_nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
