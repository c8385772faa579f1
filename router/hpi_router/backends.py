"""The live backend set: one `Backend` per upstream URL, fed by sources through `BackendPool.apply`.

A `Backend` owns what the router knows about one replica: requests in flight through this router, the
last scraped gauges, its measured decode speed and whether it is ejected. Policy code never sees these
objects, only the frozen `BackendView` snapshots they hand out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hpi_router.signals import ScrapeSample

logger = logging.getLogger(__name__)

SPEED_EWMA_WEIGHT = 0.3  # weight of the newest decode-speed sample


@dataclass(frozen=True)
class BackendView:
    """What the policy reads about one backend, at one instant."""

    url: str
    in_flight: int  # requests through this router, not yet finished
    num_running: float  # scraped
    num_waiting: float  # scraped
    kv_usage: float  # scraped, 0..1
    decode_speed: float | None  # tokens/s one busy request sees there; None until measured
    in_flight_at_scrape: int = 0  # this router's in-flight count when the gauges were scraped
    num_picks: int = 0  # requests this router has sent it, ever (breaks ties: idle backends take turns)


class Backend:
    def __init__(self, url: str):
        self.url = url
        self.in_flight = 0
        self.ready = False  # new backends are probed (/ready) before they take traffic
        self.ejected_reason: str | None = "not probed yet"
        self.num_running = 0.0
        self.num_waiting = 0.0
        self.kv_usage = 0.0
        self.decode_speed: float | None = None
        self.in_flight_at_scrape = 0
        self.num_picks = 0
        self._last_tokens: tuple[float, float] | None = None  # (monotonic s, generation tokens)

    def view(self) -> BackendView:
        return BackendView(self.url, self.in_flight, self.num_running, self.num_waiting, self.kv_usage,
                           self.decode_speed, self.in_flight_at_scrape, self.num_picks)

    def observe(self, sample: ScrapeSample, now_s: float | None = None) -> None:
        """Take one scrape: gauges as they are; decode speed from the generation-token counter's delta over the
        interval, divided by the requests busy there: the larger of the scraped running batch and this router's
        requests in flight, so that requests stuck before the engine runs them (queued in its frontend, a
        starved CPU) slow the estimate down too. An interval busy at both ends with no token out is a speed of
        0; idle ones are skipped (they measure nothing)."""
        now_s = time.monotonic() if now_s is None else now_s
        previous_busy = max(self.num_running, self.in_flight_at_scrape)
        self.num_running = sample.num_running or 0.0
        self.num_waiting = sample.num_waiting or 0.0
        self.kv_usage = sample.kv_usage or 0.0
        self.in_flight_at_scrape = self.in_flight
        if sample.generation_tokens is None:
            return
        busy = max(self.num_running, self.in_flight)
        last, self._last_tokens = self._last_tokens, (now_s, sample.generation_tokens)
        if last is None or now_s <= last[0]:
            return
        new_tokens = sample.generation_tokens - last[1]
        if new_tokens < 0 or (new_tokens == 0 and min(previous_busy, busy) == 0):
            return  # a restart (counter reset), or (maybe) idle
        speed = new_tokens / (now_s - last[0]) / max(1.0, (previous_busy + busy) / 2)
        self.decode_speed = speed if self.decode_speed is None else (
            SPEED_EWMA_WEIGHT * speed + (1 - SPEED_EWMA_WEIGHT) * self.decode_speed)

    def eject(self, reason: str) -> bool:
        """Stop sending it traffic until a /ready probe passes; True if it was taking traffic."""
        was_ready, self.ready, self.ejected_reason = self.ready, False, reason
        self._last_tokens = None
        return was_ready

    def restore(self) -> None:
        self.ready, self.ejected_reason = True, None


class BackendPool:
    """The backend set. Sources call `apply(urls)` with the full current set; removed backends' requests in
    flight finish on their own (the objects live on in those requests)."""

    def __init__(self, on_change: Callable[[], None] | None = None):
        self._backends: dict[str, Backend] = {}
        self._on_change = on_change

    def apply(self, urls: Iterable[str]) -> None:
        wanted = {url.rstrip("/") for url in urls}
        added = wanted - self._backends.keys()
        removed = self._backends.keys() - wanted
        for url in removed:
            del self._backends[url]
        for url in sorted(added):
            self._backends[url] = Backend(url)
        if added or removed:
            logger.info("backends: %d (+%s -%s)", len(self._backends), sorted(added), sorted(removed))
            if self._on_change is not None:
                self._on_change()

    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def ready(self) -> list[Backend]:
        return [b for b in self._backends.values() if b.ready]

    def get(self, url: str) -> Backend | None:
        return self._backends.get(url)

    def urls(self) -> list[str]:
        return sorted(self._backends)
