"""`hpi router`: its arguments and its entry point (cli.py only registers them)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import sys
from types import SimpleNamespace


def add_router_parser(sub, parse_bytes) -> None:
    from hpi_runtime.router.config import STRATEGIES, PolicySettings, RouterSettings

    defaults = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(RouterSettings)})
    policy = PolicySettings()
    router = sub.add_parser(
        "router",
        help="route OpenAI requests over several `hpi serve` replicas by load",
        description="An OpenAI-compatible reverse proxy: picks a backend per request from its live load "
        "(in-flight requests, scraped vllm: gauges, measured decode speed) with prefix affinity under bounded "
        "load, streams SSE through, fails over before the first byte. See docs/router.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    backends = router.add_argument_group("backends")
    backends.add_argument("--backend", action="append", default=[], metavar="URL",
                          help="a backend's base URL, e.g. http://10.0.0.5:8000 (repeatable)")
    backends.add_argument("--discover-service", default=None, metavar="NAME",
                          help="discover backends from the EndpointSlices of this (headless) Service; "
                          "needs the kubernetes extra")
    backends.add_argument("--namespace", default=None,
                          help="the Service's namespace; default: the pod's own namespace, else 'default'")
    backends.add_argument("--discover-port", default=None, metavar="PORT_NAME",
                          help="the EndpointSlice port (by name) to send to; default: its first port")
    picking = router.add_argument_group("picking")
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
    http = router.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    http.add_argument("--port", type=int, default=8080, help="port to bind")
    http.add_argument("--max-request-body", type=parse_bytes, default=defaults.max_request_body_bytes,
                      help="larger request bodies get HTTP 413")
    http.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s,
                      help="seconds to let in-flight requests finish after SIGTERM")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _pod_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def run_router(args: argparse.Namespace) -> int:
    from hpi_runtime.router.config import DiscoverySettings, PolicySettings, RouterSettings
    from hpi_runtime.router.main import serve

    try:
        discovery = None
        if args.discover_service:
            if importlib.util.find_spec("kubernetes") is None:
                raise ValueError("--discover-service needs the kubernetes client: pip install "
                                 "'hpi-runtime[kubernetes]'")
            discovery = DiscoverySettings(args.discover_service, args.namespace or _pod_namespace(),
                                          args.discover_port)
        settings = RouterSettings(
            backend_urls=tuple(args.backend),
            discovery=discovery,
            policy=PolicySettings(strategy=args.strategy, affinity_prefix_chars=args.affinity_prefix_chars,
                                  affinity_load_factor=args.affinity_load_factor),
            scrape_interval_s=args.scrape_interval,
            probe_interval_s=args.probe_interval,
            max_attempts=args.max_attempts,
            max_request_body_bytes=args.max_request_body,
            drain_timeout_s=args.drain_timeout,
        )
    except ValueError as exc:
        print(f"hpi router: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(settings, args.host, args.port))
