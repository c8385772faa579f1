"""The router in the loop: hpi_router's own state and policy, driven exactly as the proxy and the monitor drive
them, with the simulation's clock and replicas in place of HTTP. Every router-facing line of the simulator is in
this file, so that a change to the router's internals has one place to adapt.

What the real router does, and the call made here for it:
- discovery (EndpointSlices) hands the backend set to `BackendPool.apply(urls)`; the monitor's /ready probe
  then lets each new backend in with `BackendPool.restore(backend)` (`set_backends`: a replica that turned ready);
- proxy.py per request: `RouterState.choose(key, exclude)`, then `BackendPool.started(backend)`, and
  `BackendPool.finished(backend)` when the response ends (`pick`, `finish`); there is no prompt text here, so no
  affinity key (None), and no retries (a simulated backend does not fail);
- monitor.py per scrape of a ready backend: `BackendPool.observe(backend, ScrapeSample(...), now_s)` with the
  gauges, the generation-token counter and the pool profile (`hpi serve --pool-profile`) the runtime exports
  (`observe`), and `BackendPool.rescale()` once the round is done (`end_scrape_round`);
- a draining pod leaves the EndpointSlice (`set_backends` without it); its requests in flight finish on the
  Backend object they hold, as in proxy.py.
Left out: the router's own Prometheus counters (observability only, no decision reads them).
"""

from __future__ import annotations

from collections.abc import Iterable

from hpi_contracts.pool_profile import PoolProfile
from hpi_router.backends import Backend
from hpi_router.config import DiscoverySettings, PolicySettings, RouterSettings
from hpi_router.signals import ScrapeSample
from hpi_router.state import RouterState

STRATEGIES = ("load", "round-robin")  # hpi_router.config.STRATEGIES: capacity-aware, and the Service-like baseline


def _url(name: str) -> str:
    return f"http://{name}"


class SimRouter:
    def __init__(self, strategy: str = "load", scrape_interval_s: float | None = None):
        policy = PolicySettings(strategy=strategy, affinity_prefix_chars=0)
        interval = {} if scrape_interval_s is None else {"scrape_interval_s": scrape_interval_s}  # None: the router's
        discovery = DiscoverySettings(service="fleet-sim", namespace="sim")
        self.state = RouterState(RouterSettings(discovery=discovery, policy=policy, **interval))

    @property
    def scrape_interval_s(self) -> float:
        return self.state.settings.scrape_interval_s

    def set_backends(self, names: Iterable[str]) -> None:
        """The ready replicas now: new ones are probed ready at once, removed ones take no new requests."""
        pool = self.state.pool
        pool.apply(_url(n) for n in names)
        for backend in pool.all():
            if not backend.ready:
                pool.restore(backend)

    def pick(self) -> tuple[str, Backend] | None:
        """The replica for one request (its name, and the handle to give back to `finish`); None: none ready."""
        choice = self.state.choose(None, exclude=set())
        if choice is None:
            return None
        backend, _ = choice
        self.state.pool.started(backend)
        return backend.url.removeprefix("http://"), backend

    def finish(self, handle: Backend) -> None:
        self.state.pool.finished(handle)

    def observe(self, name: str, num_running: float, num_waiting: float, kv_usage: float,
                generation_tokens: float, now_s: float, profile: PoolProfile | None = None) -> None:  # fmt: skip
        backend = self.state.pool.get(_url(name))
        if backend is not None and backend.ready:
            sample = ScrapeSample(num_running=num_running, num_waiting=num_waiting, kv_usage=kv_usage,
                                  generation_tokens=generation_tokens, ready=True, profile=profile)  # fmt: skip
            self.state.pool.observe(backend, sample, now_s=now_s)

    def end_scrape_round(self) -> None:
        self.state.pool.rescale()
