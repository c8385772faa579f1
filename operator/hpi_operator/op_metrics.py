"""The operator's own Prometheus metrics (not the runtime's: those are in metric_names.py)."""

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

    def count_reconcile(self, result: str) -> None:
        self._reconciles.labels(result=result).inc()

    def set_nodes(self, kind: str, count: int) -> None:
        self._nodes.labels(kind=kind).set(count)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
