"""drift.in_sync: the operator writes a child only when what it declares is not what is there."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hpi_operator.drift import declared_in, in_sync
from hpi_operator.manifests import stamp_hash


def desired() -> dict[str, Any]:
    return stamp_hash({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "labels": {"app": "x"}, "annotations": {}},
        "spec": {
            "replicas": 2,
            "template": {"spec": {
                "containers": [{"name": "runtime", "image": "img:1", "args": ["serve", "--port", "8000"],
                                "resources": {"limits": {"memory": "17408Mi"}, "requests": {"cpu": "500m"}}}],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
            }},
        },
    })  # fmt: skip


def as_stored(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as an API server hands it back: defaults added, quantities canonical, bookkeeping fields."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="u", resourceVersion="7", generation=3)
    live["metadata"]["labels"]["added-by-someone"] = "yes"
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "3"
    container = live["spec"]["template"]["spec"]["containers"][0]
    container.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    container["resources"]["limits"]["memory"] = "17Gi"  # 17408Mi, canonical
    live["spec"]["progressDeadlineSeconds"] = 600
    live["status"] = {"replicas": 2}
    return live


def test_a_child_as_the_server_stores_it_is_in_sync() -> None:
    assert in_sync(desired(), as_stored(desired()))


def test_hand_edits_of_declared_fields_are_drift() -> None:
    for edit in (
        lambda o: o["spec"].update(replicas=5),
        lambda o: o["spec"]["template"]["spec"]["containers"][0].update(image="img:hacked"),
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["args"].append("--debug"),
        lambda o: o["metadata"]["labels"].update(app="other"),
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update(memory="1Gi"),
        lambda o: o["spec"]["template"]["spec"].pop("volumes"),
    ):
        live = as_stored(desired())
        edit(live)
        assert not in_sync(desired(), live)


def test_a_changed_declaration_is_drift_even_when_only_a_field_was_dropped() -> None:
    """Dropping a field keeps `desired` a subset of what is live: only the hash says an apply is due (the apply
    then removes the field the operator no longer declares)."""
    live = as_stored(desired())
    smaller = desired()
    smaller["spec"]["template"]["spec"].pop("volumes")
    assert declared_in({k: v for k, v in smaller.items() if k != "kind"}, live)
    assert not in_sync(stamp_hash(smaller), live)


def test_quantities_and_empty_maps_compare_as_the_server_stores_them() -> None:
    assert declared_in({"cpu": "0.5"}, {"cpu": "500m"})
    assert not declared_in({"cpu": "1"}, {"cpu": "500m"})
    assert declared_in({"annotations": {}}, {})  # an empty map is not stored
    assert not declared_in({"image": "a"}, {"image": "b"})
    assert not declared_in({"args": ["a", "b"]}, {"args": ["a"]})


def _lists(obj: Any, schema: Any, path: tuple[str, ...] = ()) -> Any:
    """(field-name path, list schema) of every non-empty list in `obj`, walking its published schema."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _lists(value, schema.field(key) if schema is not None else None, (*path, key))
    elif isinstance(obj, list) and obj:
        yield path, schema
        for item in obj:
            yield from _lists(item, schema.items() if schema is not None else None, path)


ALL_CHILDREN_SPECS = (
    {"replicas": 2, "runtime": {"env": [{"name": "LOG", "value": "1"}], "imagePullSecrets": [{"name": "reg"}]},
     "apiKeySecretRef": {"name": "api"}, "placement": {"tolerations": [{"key": "spot", "operator": "Exists"}]},
     "autoscaling": {"enabled": True, "mode": "hpa", "maxReplicas": 4}},
    {"replicas": 2, "routing": {"mode": "inferencePool"}, "autoscaling": {"enabled": True, "mode": "keda"}},
    {"replicas": 1, "routing": {"mode": "service"},
     "model": {"source": "huggingface", "huggingface": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
               "cache": {"enabled": True}}},
)  # fmt: skip


@pytest.mark.parametrize("spec", ALL_CHILDREN_SPECS)
def test_the_operators_list_keys_are_the_published_ones_for_every_list_it_writes(spec: dict[str, Any]) -> None:
    """drift.MAP_LIST_KEYS is a copy of what the Kubernetes OpenAPI says: checked for every list in every child
    (built-in kinds; InferencePool and ScaledObject lists are compared atomically, as their CRDs leave them)."""
    from hpi_operator.drift import map_list_keys
    from hpi_operator.nodes import node_info
    from hpi_operator.plan import make_plan
    from hpi_testing.k8s_openapi import builtin_schema
    from hpi_testing.kube_emulator import L4, make_node

    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "d", "namespace": "ns", "uid": "u"}, "spec": spec}  # fmt: skip
    plan = make_plan(body, [node_info(make_node("g", gpu=L4)), node_info(make_node("c", bf16=True))])
    checked = 0
    for child in plan.children:
        schema = builtin_schema(child["apiVersion"], child["kind"])
        if schema is None:
            continue
        for path, list_schema in _lists(child, schema):
            published = list_schema.map_keys if list_schema is not None and list_schema.list_type == "map" else None
            assert map_list_keys(path) == published, (child["kind"], path)
            checked += 1
    assert checked >= 5
