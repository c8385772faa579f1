"""`hpi-operator run` (the kopf operator) and `hpi-operator render` (the manifests it would create, offline)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from .names import KIND, NODE_PRICE_LABEL
from .network_policies import OperatorIdentity, parse_self_labels
from .nodes import node_info
from .plan import make_plan
from .reconcile import unplaceable_message
from .spec import SpecError
from .status import pool_statuses


def _load_documents(path: str) -> list[dict[str, Any]]:
    """YAML documents from `path` ("-" for stdin), with v1 List / NodeList wrappers unpacked."""
    stream = sys.stdin if path == "-" else open(path)
    try:
        documents = [d for d in yaml.safe_load_all(stream) if d]
    finally:
        if stream is not sys.stdin:
            stream.close()
    unpacked: list[dict[str, Any]] = []
    for document in documents:
        unpacked.extend(document.get("items") or [] if str(document.get("kind", "")).endswith("List") else [document])
    return unpacked


def render(cr_path: str, nodes_path: str, out: Any = None, err: Any = None) -> int:
    """Print the children of every InferenceDeployment in `cr_path` for the nodes in `nodes_path`."""
    out, err = out or sys.stdout, err or sys.stderr
    nodes = [node_info(n) for n in _load_documents(nodes_path) if n.get("kind", "Node") == "Node"]
    crs = [d for d in _load_documents(cr_path) if d.get("kind") == KIND]
    if not crs:
        print(f"error: no {KIND} in {cr_path}", file=err)
        return 2
    manifests: list[dict[str, Any]] = []
    failed = False
    for cr in crs:
        name = (cr.get("metadata") or {}).get("name", "?")
        try:
            plan = make_plan(cr, nodes, assume_cached=True)
        except SpecError as e:
            print(f"error: {KIND} {name}: {e}", file=err)
            failed = True
            continue
        for pool in pool_statuses(plan, {}):
            replicas = f"{pool['replicas']} replica(s)" if "replicas" in pool else "unused"
            print(f"# {name} pool {pool['name']}: {replicas}; {pool['reason']}", file=err)
        print(f"# {name} routing: {plan.routing_mode}", file=err)
        if not plan.placeable:
            print(f"error: {KIND} {name}: {unplaceable_message(plan)}", file=err)
            failed = True
            continue
        manifests.extend(plan.children)
        if plan.cache:
            manifests.append(plan.cache.fill_job)
        # The profiling Jobs a first reconcile would create (one per pool the profile cache has no figures for).
        manifests.extend(target.job for target in plan.profile_targets)
    yaml.safe_dump_all(manifests, out, sort_keys=False)
    return 2 if failed else 0


def self_identity(args: argparse.Namespace) -> OperatorIdentity | None:
    """The operator's own pod from --self-namespace and --self-labels (the chart sets both); None unless both."""
    labels = parse_self_labels(args.self_labels or "")
    return OperatorIdentity(args.self_namespace, labels) if args.self_namespace and labels else None


def run(args: argparse.Namespace) -> int:
    import kopf

    from .handlers import OperatorConfig, build_registry

    kopf.configure(verbose=args.verbose, debug=args.debug)
    config = OperatorConfig(resync_interval_s=args.resync_interval, metrics_port=args.metrics_port or None,
                            node_price_label=args.node_price_label, identity=self_identity(args))  # fmt: skip
    kopf.run(
        registry=build_registry(config),
        standalone=True,  # one replica (the chart's Deployment uses the Recreate strategy): no peering CRD
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
    )
    return 0


def _labels(text: str) -> str:
    try:
        parse_self_labels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpi-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the operator (in a cluster, or against $KUBECONFIG)")
    run_parser.add_argument(
        "-n", "--namespace", action="append", default=[],
        help="watch only this namespace (repeatable; globs allowed); default: all namespaces",
    )  # fmt: skip
    run_parser.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz",
        help="kopf's liveness endpoint for the pod's livenessProbe ('' disables it)",
    )  # fmt: skip
    run_parser.add_argument("--metrics-port", type=int, default=9090, help="the operator's /metrics (0 disables)")
    run_parser.add_argument(
        "--resync-interval", type=float, default=10.0,
        help="the longest an InferenceDeployment waits for its next reconcile without an event of its own or of a "
        "child (node inventory changes are picked up then)",
    )  # fmt: skip
    run_parser.add_argument(
        "--node-price-label", default=os.environ.get("HPI_NODE_PRICE_LABEL", NODE_PRICE_LABEL),
        help="the node label holding a node's price per node-hour as a decimal string, which the fleet optimizer "
        "prices pools without spec.placement.pools[].costPerHour from ('' reads none; env HPI_NODE_PRICE_LABEL)",
    )  # fmt: skip
    run_parser.add_argument(
        "--self-labels", default=os.environ.get("HPI_SELF_LABELS", ""), type=_labels,
        help="labels selecting the operator's own pod, k=v,k2=v2: spec.networkPolicy admits it to the pods it "
        "scrapes (env HPI_SELF_LABELS; the chart sets it)",
    )  # fmt: skip
    run_parser.add_argument(
        "--self-namespace", default=os.environ.get("POD_NAMESPACE", ""),
        help="the operator pod's namespace (env POD_NAMESPACE, which the chart sets)",
    )  # fmt: skip
    run_parser.add_argument("-v", "--verbose", action="store_true")
    run_parser.add_argument("--debug", action="store_true")
    render_parser = commands.add_parser("render", help="print the manifests the operator would create, offline")
    render_parser.add_argument("-f", "--cr", required=True, help="InferenceDeployment YAML ('-' for stdin)")
    render_parser.add_argument(
        "--nodes", required=True, help="Node objects: `kubectl get nodes -o yaml` output or a YAML stream of Nodes"
    )
    args = parser.parse_args(argv)
    if args.command == "render":
        return render(args.cr, args.nodes)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
