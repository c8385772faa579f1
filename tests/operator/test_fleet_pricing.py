"""Pools priced from their nodes' price labels: the share of a node one replica takes, the mean over the pool's
nodes, the spec's costPerHour overriding, bad label values ignored with a reason, and the real operator under the
API emulator pricing pools from labelled nodes into status.autoscaling.optimizer."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from hpi_operator.autoscaling.fleet_loop import fleet_poll
from hpi_operator.cli import main as cli_main
from hpi_operator.fleet.pricing import NodePrices, label_price, node_prices, parse_node_price
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.names import NODE_PRICE_LABEL
from hpi_operator.nodes import node_info
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.plan import make_plan
from hpi_testing.kube_emulator import H200, L4, eventually, make_node, operator_thread

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
LABEL = NODE_PRICE_LABEL
FAST = {"itlAlphaMs": 10, "itlBetaMs": 0.2, "prefillTokensPerSecond": 20000, "maxNumSeqs": 200}
SMALL = {"itlAlphaMs": 30, "itlBetaMs": 1.0, "prefillTokensPerSecond": 4000, "maxNumSeqs": 40}
CPU = {"itlAlphaMs": 40, "itlBetaMs": 2.0, "prefillTokensPerSecond": 800, "maxNumSeqs": 16}


def priced_nodes(h200: tuple[str, str] = ("40", "48"), l4: tuple[str | None, ...] = ("0.8", "1.0")) -> list[dict]:
    """Two 8-GPU H200 nodes and L4 nodes (one GPU each), labelled with those prices per node-hour."""
    nodes = [make_node(f"h200-{i}", gpu=H200, labels={LABEL: p}) for i, p in enumerate(h200)]
    nodes += [make_node(f"l4-{i}", gpu=L4, labels={LABEL: p} if p is not None else None) for i, p in enumerate(l4)]
    return nodes


def cr(pools: list[dict[str, Any]], name: str = "fleet") -> dict[str, Any]:
    settings = {"enabled": True, "mode": "optimizer", "pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 0}
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": 1, "slo": {"ttftP90": "1s", "itlP90": "100ms"}, "autoscaling": settings,
                     "placement": {"pools": pools}}}  # fmt: skip


GPU_POOLS = [{"name": "gpu-h200", "performance": FAST}, {"name": "gpu-l4", "performance": SMALL}]


def poll(body: dict[str, Any], nodes: list[dict]) -> dict[str, Any]:
    infos = [node_info(n) for n in nodes]
    plan = make_plan(body, infos)
    return fleet_poll(plan, [], {}, dict(plan.replicas_by_pool), 0.0, node_prices(LABEL, infos)).status


def test_a_price_label_is_a_non_negative_decimal_per_node_hour() -> None:
    assert parse_node_price("2.48") == 2.48 and parse_node_price("0") == 0
    for bad in ("$2.48", "2,48", "-1", "nan", "inf", ""):
        with pytest.raises(ValueError, match="price per node-hour"):
            parse_node_price(bad)


def test_a_replica_pays_its_share_of_the_node_averaged_over_the_pools_nodes() -> None:
    status = poll(cr(GPU_POOLS), priced_nodes())
    pools = status["pools"]
    # One GPU of eight per replica: 40/8 = 5 and 48/8 = 6 per hour, mean 5.5; an L4 replica takes its whole node.
    assert pools["gpu-h200"]["costPerHour"] == pytest.approx(5.5) and pools["gpu-h200"]["costSource"] == "nodeLabel"
    assert pools["gpu-l4"]["costPerHour"] == pytest.approx(0.9) and pools["gpu-l4"]["pricedNodes"] == 2
    assert status["leftOut"] is None


def test_a_cpu_replica_pays_the_share_of_node_memory_it_requests() -> None:
    nodes = [make_node("cpu-0", bf16=True, memory="64Gi", labels={LABEL: "1.6"})]
    infos = [node_info(n) for n in nodes]
    plan = make_plan(cr([{"name": "cpu-amd64-bf16", "performance": CPU}]), infos)
    choice = next(c for c in plan.choices if c.profile is not None)
    price = label_price(choice.pool, choice.profile, node_prices(LABEL, infos))
    assert price.cost_per_hour == pytest.approx(1.6 * choice.profile.needed_bytes / 2**36)


def test_the_specs_cost_overrides_the_labels_and_bad_labels_are_ignored_with_a_reason() -> None:
    pools = [{"name": "gpu-h200", "performance": FAST, "costPerHour": 7.0}, {"name": "gpu-l4", "performance": SMALL}]
    status = poll(cr(pools), priced_nodes(l4=("0.8", "cheap", None)))
    assert status["pools"]["gpu-h200"] == {**status["pools"]["gpu-h200"], "costPerHour": 7.0, "costSource": "spec"}
    l4 = status["pools"]["gpu-l4"]
    # l4-1's value is not a number: ignored (said why); l4-2 has no label: not counted; l4-0 alone prices the pool.
    assert l4["costPerHour"] == pytest.approx(0.8) and l4["pricedNodes"] == 1
    assert l4["ignoredPrices"] == [f"node l4-1: label {LABEL}='cheap' is not a decimal price per node-hour"]
    everything_bad = poll(cr(GPU_POOLS), priced_nodes(l4=("-3",)))
    assert "gpu-l4" not in everything_bad["pools"]
    why = everything_bad["leftOut"]["gpu-l4"]
    assert why.startswith("no price") and "node l4-0: label" in why and "'-3' is not a non-negative" in why


def test_the_label_key_is_an_operator_setting() -> None:
    infos = [node_info(n) for n in priced_nodes()]
    assert node_prices("", infos) == NodePrices("", {})  # emptied: no label is read
    assert node_prices("example.com/hourly", infos).values == {}


def test_the_cli_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr("hpi_operator.cli.run", lambda args: seen.setdefault("label", args.node_price_label) and 0)
    cli_main(["run"])
    assert seen.pop("label") == LABEL
    monkeypatch.setenv("HPI_NODE_PRICE_LABEL", "karpenter.example.com/price")
    cli_main(["run"])
    assert seen.pop("label") == "karpenter.example.com/price"
    cli_main(["run", "--node-price-label", "cloud.example.com/hourly"])
    assert seen.pop("label") == "cloud.example.com/hourly"


async def test_the_operator_prices_pools_from_labelled_nodes(kube: KubeClient, api: Any, emulator: Any) -> None:
    custom = "pricing.example.com/hourly"  # a platform team's own key, through the operator setting
    nodes = [make_node(f"h200-{i}", gpu=H200, labels={custom: p}) for i, p in enumerate(("40", "48"))]
    nodes += [make_node("l4-0", gpu=L4, labels={custom: "0.8"}), make_node("l4-1", gpu=L4, labels={custom: "n/a"})]
    for node in nodes:
        await asyncio.to_thread(kube.request, "POST", "/api/v1/nodes", node)
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    registry = build_registry(OperatorConfig(resync_interval_s=0.5, autoscale_tick_s=0.2, node_price_label=custom))
    context = operator_thread(registry, memo=memo)
    await asyncio.to_thread(context.__enter__)
    try:
        await asyncio.to_thread(kube.request, "POST", CRS, cr(GPU_POOLS))

        def priced() -> dict[str, Any]:
            status = kube.get(f"{CRS}/fleet").get("status") or {}
            optimizer = (status.get("autoscaling") or {}).get("optimizer") or {}
            assert set(optimizer.get("pools") or ()) == {"gpu-h200", "gpu-l4"}
            return optimizer

        optimizer = await eventually(priced, timeout_s=60)
        assert optimizer["pools"]["gpu-h200"]["costPerHour"] == pytest.approx(5.5)
        assert optimizer["pools"]["gpu-l4"]["costPerHour"] == pytest.approx(0.8)
        assert optimizer["pools"]["gpu-l4"]["ignoredPrices"] == [f"node l4-1: label {custom}='n/a' is not a decimal "
                                                                 "price per node-hour"]  # fmt: skip
        # The fleet's cost is the priced replicas it runs (the minimum of one, on the cheapest pool per request).
        running = optimizer["replicas"]
        expected = 5.5 * running.get("gpu-h200", 0) + 0.8 * running.get("gpu-l4", 0)
        assert sum(running.values()) >= 1 and optimizer["costPerHour"] == pytest.approx(expected)
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)
