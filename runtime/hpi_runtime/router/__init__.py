"""`hpi router`: an OpenAI-compatible reverse proxy that spreads requests over runtime replicas by load.

Flow, one direction: sources (static --backend list, EndpointSlice watcher) -> `BackendPool` <- monitor
(scrapes /metrics, probes /ready of ejected backends); request -> `proxy` -> `policy.pick` over frozen
`BackendView`s (+ affinity ring order) -> forward, stream back, retry elsewhere before the first byte.
"""
