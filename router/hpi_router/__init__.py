"""`hpi-router`: an OpenAI-compatible reverse proxy that spreads requests over runtime replicas by load.

Its own package and image: it needs aiohttp, prometheus-client, the kubernetes client and hpi_contracts,
never torch or hpi_runtime (tests/router/test_packaging.py checks), so a router pod starts in a second.

Flow, one direction: sources (static --backend list, EndpointSlice watcher) -> `BackendPool` <- monitor
(scrapes /metrics, probes /ready of ejected backends; the pool re-ranks each backend it touches and rescales
once per round); request -> `proxy` -> `RouterState.choose` -> `BackendPool.choose` (a few backends along the
affinity ring, then the lowest rank in the pool's index, O(log n); `policy` holds the rules) -> forward, stream
back, retry elsewhere before the first byte; `pool.started` / `pool.finished` around each attempt.
"""
