"""drift.in_sync: the operator writes a child only when what it declares is not what is there."""

from __future__ import annotations

import copy
from typing import Any

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
