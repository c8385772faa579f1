"""`hpi-router`: the router's command line (flags -> one frozen RouterSettings -> main.serve)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from hpi_router.config import STRATEGIES, DiscoverySettings, PolicySettings, QueueSettings, RouterSettings
from hpi_router.main import serve
from hpi_router.tenants import TenantsFile

SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
              "g": 10**9, "gb": 10**9, "gib": 2**30}  # fmt: skip
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
BACKEND_API_KEY_ENV = "HPI_API_KEY"  # the runtime pods' key (hpi serve reads the same variable)


def parse_bytes(text: str) -> int:
    """'4MiB', '1.5M', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4MiB, 1MB, 1000000)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    defaults = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(RouterSettings)})
    policy = PolicySettings()
    parser = argparse.ArgumentParser(
        prog="hpi-router",
        description="An OpenAI-compatible reverse proxy over `hpi serve` replicas: picks a backend per request "
        "from its live load (in-flight requests, scraped vllm: gauges, measured decode speed) with prefix affinity "
        "under bounded load, streams SSE through, fails over before the first byte. See docs/router.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    backends = parser.add_argument_group("backends")
    backends.add_argument("--backend", action="append", default=[], metavar="URL",
                          help="a backend's base URL, e.g. http://10.0.0.5:8000 (repeatable)")
    backends.add_argument("--discover-service", default=None, metavar="NAME",
                          help="discover backends from the EndpointSlices of this (headless) Service")
    backends.add_argument("--namespace", default=None,
                          help="the Service's namespace; default: the pod's own namespace, else 'default'")
    backends.add_argument("--discover-port", default=None, metavar="PORT_NAME",
                          help="the EndpointSlice port (by name) to send to; default: its first port")
    picking = parser.add_argument_group("picking")
    picking.add_argument("--strategy", default=policy.strategy, choices=STRATEGIES,
                         help="load: by live load and measured speed, with prefix affinity; round-robin: in turn, "
                         "blind to load (a baseline)")
    picking.add_argument("--affinity-prefix-chars", type=int, default=policy.affinity_prefix_chars,
                         help="characters of the prompt hashed for prefix affinity; 0 turns affinity off")
    picking.add_argument("--affinity-load-factor", type=float, default=policy.affinity_load_factor,
                         help="an affinity target takes a request while its load is under this factor times its "
                         "fair (speed-weighted) share")
    picking.add_argument("--scrape-interval", type=float, default=defaults.scrape_interval_s,
                         help="seconds between scrapes of each backend's /metrics")
    picking.add_argument("--probe-interval", type=float, default=defaults.probe_interval_s,
                         help="seconds between /ready probes of an ejected backend")
    picking.add_argument("--max-attempts", type=int, default=defaults.max_attempts,
                         help="backends tried per request (before the first byte reaches the client)")
    queue = parser.add_argument_group("queue (requests wait here while no backend can take them)")
    queue_defaults = QueueSettings()
    queue.add_argument("--queue-max-requests", type=int, default=queue_defaults.max_queued,
                       help="requests that may wait for a backend (beyond: 503 with Retry-After); 0: no queue, "
                       "a 503 at once when no backend is ready")
    queue.add_argument("--queue-timeout", type=float, default=queue_defaults.max_wait_s,
                       help="seconds a request may wait (longer than a cold start: a pool at zero replicas)")
    queue.add_argument("--queue-saturated-waiting", type=int, default=queue_defaults.saturated_waiting,
                       help="also hold requests while every ready backend has this many waiting in its engine; "
                       "0: only while none is ready")
    queue.add_argument("--queue-reserved-slots", type=int, default=queue_defaults.reserved_slots,
                       help="slots of each backend's max_num_seqs (its pool profile) kept for urgent priorities "
                       "(< 0): the other bands wait here once a backend is that close to full; 0: none")
    door = parser.add_argument_group("tenants (the router checks API keys; see docs/router.md)")
    door.add_argument("--tenants-file", default=None, metavar="PATH",
                      help="YAML of tenants, their API keys, priority, weight, models and limits, re-read when it "
                      f"changes; the router then presents ${BACKEND_API_KEY_ENV} to the backends. Default: no "
                      "keys checked here, the client's Authorization goes to the backends")
    door.add_argument("--router-replicas", type=int, default=defaults.num_replicas, metavar="N",
                      help="replicas of this router behind its Service: each enforces 1/N of every tenant's limits "
                      "(the operator sets it from spec.routing.router.replicas)")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    http.add_argument("--port", type=_port, default=8080, help="port to bind (0: any free port)")
    http.add_argument("--max-request-body", type=parse_bytes, default=defaults.max_request_body_bytes,
                      help="larger request bodies get HTTP 413")
    http.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s,
                      help="seconds to let in-flight requests finish after SIGTERM")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free port), got {port}")
    return port


def _pod_namespace() -> str:
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """The parsed flags as one RouterSettings; ValueError names what is wrong with them."""
    discovery = None
    if args.discover_service:
        discovery = DiscoverySettings(args.discover_service, args.namespace or _pod_namespace(), args.discover_port)
    return RouterSettings(
        backend_urls=tuple(args.backend),
        discovery=discovery,
        policy=PolicySettings(strategy=args.strategy, affinity_prefix_chars=args.affinity_prefix_chars,
                              affinity_load_factor=args.affinity_load_factor),
        queue=QueueSettings(max_queued=args.queue_max_requests, max_wait_s=args.queue_timeout,
                            saturated_waiting=args.queue_saturated_waiting,
                            reserved_slots=args.queue_reserved_slots),
        scrape_interval_s=args.scrape_interval,
        probe_interval_s=args.probe_interval,
        max_attempts=args.max_attempts,
        max_request_body_bytes=args.max_request_body,
        tenants_file=args.tenants_file,
        num_replicas=args.router_replicas,
        backend_api_key=os.environ.get(BACKEND_API_KEY_ENV) or None,
        drain_timeout_s=args.drain_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        if settings.tenants_file:
            TenantsFile(Path(settings.tenants_file))  # a bad file stops the router here, not at its first request
    except (ValueError, OSError) as exc:
        print(f"hpi-router: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(settings, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
