"""Names the operator shares with the cluster: the CRD's coordinates, label and annotation keys."""

from __future__ import annotations

GROUP = "serving.hpi.dev"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

OPERATOR_NAME = "hpi-operator"
# The field manager of every server-side apply of a child (children.py): the fields the operator owns.
FIELD_MANAGER = OPERATOR_NAME
# The builtin autoscaler's field manager: it writes the InferenceDeployment's spec.replicas through the scale
# subresource, as an HPA does, and nothing else.
AUTOSCALER_FIELD_MANAGER = "hpi-autoscaler"
RUNTIME_NAME = "hpi-runtime"
RUNTIME_PORT = 8000
RUNTIME_PORT_NAME = "http"

# Recommended labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# The operator's own labels: which InferenceDeployment and which node pool a child serves.
LABEL_DEPLOYMENT = f"{GROUP}/inference-deployment"
LABEL_POOL = f"{GROUP}/pool"
# Every pod of a multi-node group (leader and workers; the value: the InferenceDeployment): its network policy
# admits the group's own traffic (torch.distributed). Workers carry no LABEL_DEPLOYMENT: they serve nobody.
LABEL_GROUP_MEMBER = f"{GROUP}/group-member"

# Set on every child: the hash of its declaration, so a resync that finds it in sync writes nothing (drift.py).
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"

# A node label that names its pool explicitly, overriding the grouping by accelerator/CPU features.
NODE_POOL_LABEL = f"{GROUP}/pool"
# The default node label the fleet optimizer reads a node's price per node-hour from (a decimal string, e.g.
# "2.48"), for pools whose spec sets no costPerHour. Kubernetes has no standard one; `hpi-operator run
# --node-price-label` (env HPI_NODE_PRICE_LABEL, chart value operator.nodePriceLabel) names another, e.g. the
# label a Karpenter NodePool or a cloud price table writes (fleet/pricing.py).
NODE_PRICE_LABEL = f"{GROUP}/price-per-hour"
