"""Builds the chart's Grafana dashboard (hetero-paged-infer.json beside this file) with grafana-foundation-sdk.

    python charts/hetero-paged-infer/dashboards/generate.py          # rewrite the JSON
    python charts/hetero-paged-infer/dashboards/generate.py --check  # exit 1 if the JSON is stale

Every query reads metrics the project exports: the runtime's vLLM names (runtime/hpi_runtime/server/metrics.py)
with the `inference_deployment` and `pool` labels the chart's PodMonitor adds from pod labels, the router's
(router/hpi_router/metrics.py: its queue and tenants), and the operator's own (operator/hpi_operator/op_metrics.py).
tests/chart/test_monitoring.py parses each expression and checks the names, and that this script and the JSON
agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUTPUT = Path(__file__).with_name("hetero-paged-infer.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# The runtime pods of the chosen InferenceDeployments and pools.
SEL = 'namespace=~"$namespace", inference_deployment=~"$inference_deployment", pool=~"$pool"'
BY = "inference_deployment, pool"
# The router pods of the chosen InferenceDeployments (they serve every pool: no pool label).
ROUTER_SEL = 'namespace=~"$namespace", inference_deployment=~"$inference_deployment"'
RATE = "$__rate_interval"
LEGEND = "{{inference_deployment}} / {{pool}}"


def query(expr: str, legend: str = LEGEND, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def quantiles(metric: str) -> list[prometheus.Dataquery]:
    """p50 / p90 / p99 of a runtime histogram, per InferenceDeployment and pool."""
    return [
        query(f"histogram_quantile({q}, sum by (le, {BY}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
              f"p{round(q * 100)} {LEGEND}", ref)  # fmt: skip
        for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ]


def panel(title: str, unit: str, targets: list[prometheus.Dataquery], description: str) -> timeseries.Panel:
    built = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(12)
        .fill_opacity(10)
        .legend(common.VizLegendOptions().show_legend(True).display_mode(common_models.LegendDisplayMode.TABLE)
                .placement(common_models.LegendPlacement.BOTTOM).calcs(["mean", "max", "lastNotNull"]))  # fmt: skip
    )
    for target in targets:
        built = built.with_target(target)
    return built


def variable(name: str, label: str, expr: str) -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": expr, "refId": f"{name}-values"})
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def build() -> dict:
    """The dashboard as a JSON-ready dict."""
    board = (
        dashboard.Dashboard("hetero-paged-infer")
        .uid("hetero-paged-infer")
        .description("LLM serving per InferenceDeployment and node pool: traffic, latency, KV cache, scaling.")
        .tags(["hetero-paged-infer", "vllm", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"))
        .with_variable(variable(
            "inference_deployment", "InferenceDeployment",
            'label_values(vllm:num_requests_running{namespace=~"$namespace"}, inference_deployment)',
        ))  # fmt: skip
        .with_variable(variable(
            "pool", "Pool",
            'label_values(vllm:num_requests_running{namespace=~"$namespace", '
            'inference_deployment=~"$inference_deployment"}, pool)',
        ))  # fmt: skip
        .with_row(dashboard.Row("Traffic and latency"))
        .with_panel(panel("Requests / s", "reqps", [
            query(f"sum by ({BY}) (rate(vllm:request_success_total{{{SEL}}}[{RATE}]))"),
        ], "Finished requests per second (every finish reason)."))
        .with_panel(panel("Tokens / s", "short", [
            query(f"sum by ({BY}) (rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))", f"generated {LEGEND}"),
            query(f"sum by ({BY}) (rate(vllm:prompt_tokens_total{{{SEL}}}[{RATE}]))", f"prompt {LEGEND}", "B"),
        ], "Generated (decode) and prompt (prefill) tokens per second."))
        .with_panel(panel("Time to first token", "s", quantiles("vllm:time_to_first_token_seconds"),
                          "From arrival to the first output token: queueing plus prefill."))
        .with_panel(panel("Inter-token latency", "s", quantiles("vllm:inter_token_latency_seconds"),
                          "Time between output tokens of a running request: the decode speed users see."))
        .with_row(dashboard.Row("KV cache and scheduling"))
        .with_panel(panel("KV-cache usage", "percentunit", [
            query(f"avg by ({BY}) (vllm:kv_cache_usage_perc{{{SEL}}})", f"mean {LEGEND}"),
            query(f"max by ({BY}) (vllm:kv_cache_usage_perc{{{SEL}}})", f"fullest pod {LEGEND}", "B"),
        ], "Fraction of KV blocks in use; the builtin autoscaler's signal."))
        .with_panel(panel("Waiting and running requests", "short", [
            query(f"sum by ({BY}) (vllm:num_requests_waiting{{{SEL}}})", f"waiting {LEGEND}"),
            query(f"sum by ({BY}) (vllm:num_requests_running{{{SEL}}})", f"running {LEGEND}", "B"),
        ], "Requests queued for admission and requests in the running batch."))
        .with_panel(panel("Preemptions / s", "short", [
            query(f"sum by ({BY}) (rate(vllm:num_preemptions_total{{{SEL}}}[{RATE}]))"),
        ], "Running requests evicted (recomputed later) because KV blocks ran out."))
        .with_panel(panel("Prefix-cache hit rate", "percentunit", [
            query(f"sum by ({BY}) (rate(vllm:prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
                  f"sum by ({BY}) (rate(vllm:prefix_cache_queries_total{{{SEL}}}[{RATE}]))"),
        ], "Prompt tokens served from cached KV blocks, of all prompt tokens looked up."))
        .with_panel(panel("Speculative decoding acceptance rate", "percentunit", [
            query(f"sum by ({BY}) (rate(vllm:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}])) / "
                  f"sum by ({BY}) (rate(vllm:spec_decode_num_draft_tokens_total{{{SEL}}}[{RATE}]))"),
        ], "Draft tokens accepted, of all verified (pods with --speculative-config); each verification also "
           "yields one token of its own."))
        .with_row(dashboard.Row("LoRA adapters"))
        .with_panel(panel("Adapter loads and evictions / s", "short", [
            query(f"sum by ({BY}) (rate(hpi:lora_loads_total{{{SEL}}}[{RATE}]))", f"loads {LEGEND}"),
            query(f"sum by ({BY}) (rate(hpi:lora_evictions_total{{{SEL}}}[{RATE}]))", f"evictions {LEGEND}", "B"),
        ], "Adapters copied into a device slot (--max-loras) and dropped from host memory (--max-cpu-loras): a "
           "steady load rate means more adapters are in use than the slots hold (spec.engine.maxLoras)."))
        .with_panel(panel("Router picks by reason", "reqps", [
            query(f"sum by (inference_deployment, reason) (rate(hpi:router_picks_total{{{ROUTER_SEL}}}[{RATE}]))",
                  "{{inference_deployment}} {{reason}}"),
        ], "How the router chose each backend: adapter (where the LoRA adapter is resident), adapter_slot (a "
           "free adapter slot), affinity (the prompt prefix), load, round_robin."))
        .with_row(dashboard.Row("Router: queue and tenants"))
        .with_panel(panel("Requests waiting in the router", "short", [
            query(f"sum by (inference_deployment, tenant, priority) (hpi:router_queued_requests{{{ROUTER_SEL}}})",
                  "{{inference_deployment}} {{tenant}} (priority {{priority}})"),
        ], "Requests the router holds for a backend: none ready (a pool starting from zero) or every engine "
           "saturated (--queue-saturated-waiting); the operator scales on it."))
        .with_panel(panel("Router queue wait", "s", [
            query(f"histogram_quantile({q}, sum by (le, inference_deployment, tenant) "
                  f"(rate(hpi:router_queue_wait_seconds_bucket{{{ROUTER_SEL}}}[{RATE}])))",
                  f"p{round(q * 100)} {{{{inference_deployment}}}} {{{{tenant}}}}", ref)
            for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
        ], "How long queued requests waited for a backend, per tenant (served, timed out or gone)."))
        .with_panel(panel("Requests per tenant", "reqps", [
            query(f"sum by (tenant, code) (rate(hpi:router_tenant_requests_total{{{ROUTER_SEL}}}[{RATE}]))",
                  "{{tenant}} {{code}}"),
        ], "Requests per tenant by the status it got (401/404 refused, 429 over a limit, 499 client gone)."))
        .with_panel(panel("Tokens per tenant", "short", [
            query(f"sum by (tenant) (rate(hpi:router_tenant_completion_tokens_total{{{ROUTER_SEL}}}[{RATE}]))",
                  "completion {{tenant}}"),
            query(f"sum by (tenant) (rate(hpi:router_tenant_prompt_tokens_total{{{ROUTER_SEL}}}[{RATE}]))",
                  "prompt {{tenant}}", "B"),
        ], "Prompt and completion tokens per second per tenant, from the backends' usage."))
        .with_row(dashboard.Row("Replicas and autoscaling"))
        .with_panel(panel("Ready replicas", "short", [
            query(f"sum by ({BY}) (hpi:ready{{{SEL}}})"),
        ], "Runtime pods that accept requests, per pool."))
        .with_panel(panel("Autoscaler", "short", [
            query('hpi_operator_autoscaler_desired_replicas{inference_namespace=~"$namespace", '
                  'inference_deployment=~"$inference_deployment"}', "desired {{inference_deployment}}"),
            query('sum by (inference_deployment, reason) (increase(hpi_operator_autoscaler_scale_events_total{'
                  f'inference_namespace=~"$namespace", inference_deployment=~"$inference_deployment"}}[{RATE}]))',
                  "scaled: {{reason}} {{inference_deployment}}", "B"),
            query('hpi_operator_autoscaler_kv_utilization{inference_namespace=~"$namespace", '
                  'inference_deployment=~"$inference_deployment"}', "KV read by the scaler {{inference_deployment}}",
                  "C"),
        ], "The builtin autoscaler: replicas it decided on, its scale events by reason, the utilisation it read."))
        .with_panel(panel("Operator reconciles / s", "short", [
            query(f"sum by (result) (rate(hpi_operator_reconciles_total[{RATE}]))", "{{result}}"),
        ], "Reconciles by outcome: invalid, unplaceable and error want attention."))
    )
    built = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for number, item in enumerate(built["panels"], start=1):  # stable, unique ids (links and embeds use them)
        item["id"] = number
    return built


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
