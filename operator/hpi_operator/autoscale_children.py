"""Removing the external autoscaler a spec no longer asks for (mode changed, or autoscaling disabled): an HPA
left behind would keep writing spec.replicas against the builtin scaler or a fixed count.

The wanted HPA or ScaledObject is a child of the Plan and is applied with the others (kube.py); this prunes
the rest: objects of either kind labelled for this InferenceDeployment and owned by it, other than the wanted
one. A cluster without KEDA answers 404 for ScaledObjects: nothing to prune there.
"""

from __future__ import annotations

from .autoscale_manifests import AUTOSCALER_PATHS
from .kube import KubeClient, KubeError
from .manifests import selector_labels
from .plan import Plan


def prune_autoscalers(kube: KubeClient, plan: Plan, owner_uid: str | None) -> list[str]:
    """Delete this resource's HPAs/ScaledObjects other than the plan's; returns "Kind/name" of each deleted."""
    wanted = (plan.autoscaler["kind"], plan.autoscaler["metadata"]["name"]) if plan.autoscaler else None
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(plan.owner.name).items())
    deleted = []
    for kind, collection in AUTOSCALER_PATHS.items():
        path = collection.format(namespace=plan.owner.namespace)
        try:
            listing = kube.request("GET", f"{path}?labelSelector={selector}")
        except KubeError as e:
            if e.status == 404:
                continue  # the API is not served (KEDA not installed)
            raise
        for item in listing.get("items") or []:
            meta = item.get("metadata") or {}
            owned = owner_uid is None or any(r.get("uid") == owner_uid for r in meta.get("ownerReferences") or [])
            if owned and (kind, meta.get("name")) != wanted:
                kube.request("DELETE", f"{path}/{meta['name']}", {"propagationPolicy": "Background"})
                deleted.append(f"{kind}/{meta['name']}")
    return deleted
