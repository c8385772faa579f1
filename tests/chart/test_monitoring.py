"""The chart's monitoring: the runtime PodMonitor and the Grafana dashboard, checked against the metric contract.

- The dashboard JSON the chart ships is what dashboards/generate.py builds (grafana-foundation-sdk).
- Every PromQL expression parses (promql-parser) and names only metrics the project exports: the runtime's
  registry (hpi_runtime.server.metrics) and the operator's (hpi_operator.op_metrics), read from the live
  prometheus_client registries, not from a list kept by hand. Every label it groups or filters by exists on
  those series: the metric's own labels, Prometheus' target labels, or one the PodMonitor adds.
- The PodMonitor selects the pods the operator builds and copies the pod labels the dashboard groups by.
"""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

import promql_parser
import pytest

TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint", "service"}  # Prometheus Operator
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
MONITORING = {"runtimeMetrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
              "dashboard": {"enabled": True}}  # fmt: skip


@pytest.fixture(scope="module")
def generator(env) -> Any:
    spec = importlib.util.spec_from_file_location("hpi_dashboard", env.chart / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported() -> dict[str, set[str]]:
    """Every series name the runtime and the operator expose -> its labels (suffixes as Prometheus sees them)."""
    from hpi_operator.op_metrics import OperatorMetrics
    from hpi_router.metrics import RouterMetrics
    from hpi_runtime.server.metrics import ServingMetrics

    series: dict[str, set[str]] = {}
    runtime = ServingMetrics("m")
    runtime.set_max_loras(2)  # the LoRA families exist on pods with --enable-lora
    for registry in (runtime.registry, OperatorMetrics().registry, RouterMetrics().registry):
        # prometheus_client exposes no label names for a metric without children: read its collectors'.
        collector_labels = {c._name: set(c._labelnames) for c in registry._collector_to_names}
        for family in registry.collect():
            labels = collector_labels.get(family.name, set()) | ({"le"} if family.type == "histogram" else set())
            names = [family.name + s for s in SUFFIXES.get(family.type, ())] or [family.name]
            series.update(dict.fromkeys(names, labels))
    return series


def queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets") or []]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def parse(expr: str) -> Any:
    # Grafana's template variables: a range and label values stand in for them.
    match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr)
    promql = match.group(1) if match else expr
    return promql_parser.parse(promql.replace("$__rate_interval", "5m")), (match.group(2) if match else None)


def selectors_and_labels(tree: Any) -> tuple[set[str], set[str]]:
    names: set[str] = set()
    labels: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
            labels.update(m.name for m in node.matchers.matchers if m.name != "__name__")
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)

    promql_parser.walk(tree, visit)
    return names, labels


def test_the_shipped_json_is_what_the_generator_builds(generator, env):
    assert (env.chart / "dashboards" / "hetero-paged-infer.json").read_text() == generator.render()
    assert generator.main(["--check"]) == 0


def test_every_query_reads_exported_metrics_by_existing_labels(generator, env, render):
    board = generator.build()
    series = exported()
    (monitor,) = env.by_kind(render(MONITORING), "PodMonitor")
    added = {r["targetLabel"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e.get("relabelings", [])}
    checked = set()
    for expr in queries(board):
        tree, label_value = parse(expr)
        names, labels = selectors_and_labels(tree)
        assert names, f"no metric in {expr!r}"
        for name in names:
            assert name in series, f"{name!r} in {expr!r} is not a metric the runtime or operator exports"
            runtime = not name.startswith("hpi_operator_")
            available = series[name] | TARGET_LABELS | (added if runtime else set())
            missing = (labels | ({label_value} if label_value else set())) - available
            assert not missing, f"{expr!r} uses labels {missing} that {name} does not carry"
            checked.add(name)
    # The panels the issue asks for, by the metrics behind them.
    assert {
        "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket", "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total", "hpi:ready", "hpi_operator_autoscaler_desired_replicas",
        "hpi_operator_autoscaler_scale_events_total", "hpi:router_queued_requests",
        "hpi:router_queue_wait_seconds_bucket", "hpi:router_tenant_requests_total",
    } <= checked  # fmt: skip


def test_contract_check_catches_a_wrong_name(generator):
    series = exported()
    names, _ = selectors_and_labels(parse("sum(rate(vllm:request_success{x='y'}[5m]))")[0])
    assert names == {"vllm:request_success"} and "vllm:request_success" not in series  # counters need _total
    with pytest.raises(Exception):  # noqa: B017 - promql_parser raises its own error type
        promql_parser.parse("sum by (pool (rate(x[5m]))")


def selects(selector, labels) -> bool:
    """A LabelSelector's matchLabels and In/NotIn/Exists matchExpressions, as the API server reads them."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[operator]  # fmt: skip
        if not ok:
            return False
    return True


def test_pod_monitor_scrapes_the_runtime_and_router_pods_the_operator_builds(render, env):
    from hpi_operator.manifests import Owner, common_labels
    from hpi_operator.names import LABEL_COMPONENT, LABEL_INSTANCE, LABEL_POOL, RUNTIME_PORT_NAME
    from hpi_operator.routing_manifests import build_endpoint_picker, build_router_deployment, router_pod_labels
    from hpi_operator.spec import parse_spec

    (monitor,) = env.by_kind(render(MONITORING), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]
    assert selects(selector, common_labels("any")) and selects(selector, router_pod_labels(Owner("any", "ns")))
    router = build_router_deployment(Owner("any", "ns"), parse_spec({}))
    assert [p["name"] for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]] == [RUNTIME_PORT_NAME]
    picker = build_endpoint_picker(Owner("any", "ns"), parse_spec({}))  # not ours: no `http` /metrics to scrape
    assert not selects(selector, picker["spec"]["template"]["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == RUNTIME_PORT_NAME and endpoint["path"] == "/metrics"
    # Prometheus' pod-label meta labels: the key with every character outside [a-zA-Z0-9_] as "_".
    meta = {f"__meta_kubernetes_pod_label_{re.sub('[^a-zA-Z0-9_]', '_', key)}": target
            for key, target in ((LABEL_INSTANCE, "inference_deployment"), (LABEL_POOL, "pool"),
                                (LABEL_COMPONENT, "component"))}  # fmt: skip
    assert {r["sourceLabels"][0]: r["targetLabel"] for r in endpoint["relabelings"]} == meta
    watched = render({**MONITORING, "operator": {"watchNamespace": "team-a"}})
    (monitor,) = env.by_kind(watched, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_dashboard_config_map_is_labelled_for_the_sidecar(render, env):
    (config_map,) = env.by_kind(render(MONITORING), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((env.chart / "dashboards" / "hetero-paged-infer.json").read_text())
    assert json.loads(config_map["data"]["hetero-paged-infer.json"]) == shipped
    assert not {"ConfigMap", "PodMonitor"} & {m["kind"] for m in render()}  # off by default
