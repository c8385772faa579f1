"""The router's own Prometheus metrics (`hpi:router_*`), in a registry of its own (no process-global state).

Per-backend series carry the label `backend` (its URL); a backend that leaves the set has its series
removed, so a fleet that churns (pods come and go) does not grow the page without bound.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hpi_contracts.metrics import (
    PRIORITY_LABEL,
    ROUTER_QUEUE_WAIT,
    ROUTER_QUEUED_REQUESTS,
    ROUTER_TENANT_KEYS,
    TENANT_LABEL,
)
from hpi_router.backends import Backend
from hpi_router.queue import DEFAULT_TENANT, Flow

# Request latencies from 1 ms (a refusal) to minutes (a long generation). The same edges as the runtime's
# e2e histogram, so a dashboard can set the router's latency beside its backends'.
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class RouterMetrics:
    def __init__(self):
        reg = self.registry = CollectorRegistry()
        backend = ["backend"]
        self.requests = Counter("hpi:router_requests", "Requests forwarded, by backend and upstream status.",
                                backend + ["code"], registry=reg)
        self.picks = Counter("hpi:router_picks", "Backend picks, by reason (affinity, load, round_robin, adapter, "
                             "adapter_slot).",
                             backend + ["reason"], registry=reg)
        self.retries = Counter("hpi:router_retries", "Attempts that failed before the first byte and were retried "
                               "elsewhere, by the backend that failed and why.", backend + ["reason"], registry=reg)
        self.ejections = Counter("hpi:router_ejections", "Times a backend was taken out of rotation.", backend,
                                 registry=reg)
        self.stream_failures = Counter("hpi:router_stream_failures", "Responses cut off after the first byte "
                                       "because the backend failed.", backend, registry=reg)
        self.unrouted = Counter("hpi:router_unrouted_requests", "Requests answered by the router itself with an "
                                "error (no ready backend, all attempts failed).", ["reason"], registry=reg)
        self.latency = Histogram("hpi:router_request_latency_seconds", "Time from pick to the last byte.", backend,
                                 buckets=LATENCY_BUCKETS_S, registry=reg)
        self.first_byte = Histogram("hpi:router_time_to_first_byte_seconds", "Time from pick to the first "
                                    "byte from the backend.", backend, buckets=LATENCY_BUCKETS_S, registry=reg)
        self._in_flight = Gauge("hpi:router_backend_in_flight", "Requests in flight through this router.",
                                backend, registry=reg)
        self._ready = Gauge("hpi:router_backend_ready", "1 while the backend takes traffic.", backend, registry=reg)
        self._speed = Gauge("hpi:router_backend_decode_speed", "Measured tokens/s per busy request.", backend,
                            registry=reg)
        self._score_inputs = (self._in_flight, self._ready, self._speed)
        self._known: set[str] = set()
        flow = [TENANT_LABEL, PRIORITY_LABEL]
        self.queued = Gauge(ROUTER_QUEUED_REQUESTS, "Requests waiting in the router for a backend (none ready, or "
                            "all saturated), per flow; the operator reads it as demand.", flow, registry=reg)
        self.queue_wait = Histogram(ROUTER_QUEUE_WAIT, "Time each queued request waited for a backend (served, "
                                    "timed out or gone).", flow, buckets=LATENCY_BUCKETS_S, registry=reg)
        self.queued.labels(DEFAULT_TENANT, "0").set(0)  # on the page from the start: zero queued, not unknown
        tenant = [TENANT_LABEL]
        self.tenant_requests = Counter("hpi:router_tenant_requests", "Requests per tenant, by the status the client "
                                       "got (a platform's usage report).", tenant + ["code"], registry=reg)  # fmt: skip
        self.tenant_prompt_tokens = Counter("hpi:router_tenant_prompt_tokens", "Prompt tokens per tenant, from the "
                                            "backends' usage.", tenant, registry=reg)  # fmt: skip
        self.tenant_completion_tokens = Counter("hpi:router_tenant_completion_tokens", "Completion tokens per "
                                                "tenant, from the backends' usage.", tenant, registry=reg)  # fmt: skip
        self.tenant_keys = Gauge(ROUTER_TENANT_KEYS, "API keys loaded from the tenants file (0: no file).",
                                 registry=reg)  # fmt: skip

    def queue_changed(self, flow: Flow, queued: int, waited_s: float | None) -> None:
        """RequestQueue's hook: a request of `flow` entered (waited_s None) or left the queue."""
        labels = (flow.tenant, str(flow.priority))
        self.queued.labels(*labels).set(queued)
        if waited_s is not None:
            self.queue_wait.labels(*labels).observe(waited_s)

    def refresh(self, backends: list[Backend]) -> None:
        """Bring the per-backend gauges up to date and drop the series of backends that are gone."""
        current = {b.url for b in backends}
        for url in self._known - current:
            for metric in (self.requests, self.picks, self.retries, self.ejections, self.stream_failures,
                           self.latency, self.first_byte, *self._score_inputs):
                for labels in list(_label_sets(metric)):
                    if labels and labels[0] == url:
                        metric.remove(*labels)
        self._known = current
        for b in backends:
            self._in_flight.labels(b.url).set(b.in_flight)
            self._ready.labels(b.url).set(1 if b.ready else 0)
            self._speed.labels(b.url).set(b.decode_speed or 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label_sets(metric) -> list[tuple[str, ...]]:
    with metric._lock:  # prometheus_client has no public way to list a metric's children
        return list(metric._metrics)
