"""The operator's own Prometheus metrics (not the runtime's: those are in hpi_contracts.metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class OperatorMetrics:
    """A registry per operator instance, not prometheus_client's global one: tests run several operators in
    one process, and the operator keeps no module-level state."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._reconciles = Counter(
            "hpi_operator_reconciles", "Reconciles of InferenceDeployments, by outcome", ["result"],
            registry=self.registry,
        )  # fmt: skip
        self._nodes = Gauge("hpi_operator_nodes", "Nodes in the inventory, by kind", ["kind"], registry=self.registry)
        # The builtin autoscaler's decisions, per InferenceDeployment. `inference_namespace`, not `namespace`:
        # Prometheus sets `namespace` to the operator pod's own namespace when it scrapes the operator.
        resource = ["inference_namespace", "inference_deployment"]
        self._desired = Gauge(
            "hpi_operator_autoscaler_desired_replicas", "Replicas the builtin autoscaler decided on at its last poll",
            resource, registry=self.registry,
        )  # fmt: skip
        self._kv = Gauge(
            "hpi_operator_autoscaler_kv_utilization", "Mean KV-cache utilisation (0..1) the autoscaler last read",
            resource, registry=self.registry,
        )  # fmt: skip
        self._polls = Counter(
            "hpi_operator_autoscaler_polls", "Polls of the builtin autoscaler (scrape and decide), per resource",
            resource, registry=self.registry,
        )  # fmt: skip
        self._scales = Counter(
            "hpi_operator_autoscaler_scale_events", "Changes of spec.replicas by the builtin autoscaler, by reason",
            [*resource, "reason"], registry=self.registry,
        )  # fmt: skip

    def count_reconcile(self, result: str) -> None:
        self._reconciles.labels(result=result).inc()

    def set_nodes(self, kind: str, count: int) -> None:
        self._nodes.labels(kind=kind).set(count)

    def record_decision(
        self, namespace: str, name: str, desired: int, kv_utilization: float | None, scaled_reason: str | None
    ) -> None:
        """One autoscaler poll: the replicas it wants, the utilisation it read, and the reason when it scaled."""
        self._polls.labels(namespace, name).inc()
        self._desired.labels(namespace, name).set(desired)
        if kv_utilization is not None:
            self._kv.labels(namespace, name).set(kv_utilization)
        if scaled_reason:
            self._scales.labels(namespace, name, scaled_reason).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
