"""One backend: a `Backend` per upstream URL (the pool, pool.py, holds them and keeps its pick index in step).

A `Backend` owns what the router knows about one replica: requests in flight through this router, the
last scraped gauges, its pool profile (a prior for its speed), its measured decode speed and whether it is
ejected. Policy code never sees these objects, only the frozen `BackendView` snapshots they hand out. Only
`BackendPool` changes them (its `started`, `finished`, `observe`, `eject`, `restore`), so that the index it
picks from never holds a stale rank.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from hpi_contracts.pool_profile import PoolProfile
from hpi_router.signals import LoraState, ScrapeSample

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
    profile: PoolProfile | None = None  # its pool's profile (scraped): the prior speed until one is measured
    adapters: frozenset[str] = frozenset()  # LoRA adapters with requests there: scraped, or sent since by this router
    max_loras: int | None = None  # adapters one of its batches holds (scraped); None: not known (LoRA off, not scraped)


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
        self.profile: PoolProfile | None = None
        self.in_flight_at_scrape = 0
        self.num_picks = 0
        self.lora: LoraState | None = None  # scraped
        self.model_names: frozenset[str] = frozenset()  # scraped: the base model's served names
        self.adapters_in_flight: Counter[str] = Counter()  # this router's requests there, by LoRA adapter
        self._last_tokens: tuple[float, float] | None = None  # (monotonic s, generation tokens)

    def adapters(self) -> frozenset[str]:
        """The adapters resident in its batch: with requests there at the last scrape, or sent since."""
        scraped = self.lora.active if self.lora is not None else frozenset()
        if not self.adapters_in_flight:  # every view of a backend without LoRA passes here: no new set
            return scraped
        return scraped.union(self.adapters_in_flight)  # counts reach 0 only by leaving (pool.finished)

    def view(self) -> BackendView:
        return BackendView(self.url, self.in_flight, self.num_running, self.num_waiting, self.kv_usage,
                           self.decode_speed, self.in_flight_at_scrape, self.num_picks, self.profile,
                           self.adapters(), self.lora.max_loras if self.lora is not None else None)

    def observe(self, sample: ScrapeSample, now_s: float | None = None) -> None:
        """Take one scrape: gauges as they are; decode speed from the generation-token counter's delta over the
        interval, divided by the requests busy there: the larger of the scraped running batch and this router's
        requests in flight, so that requests stuck before the engine runs them (queued in its frontend, a
        starved CPU) slow the estimate down too. An interval busy at both ends with no token out is a speed of
        0; idle ones are skipped (they measure nothing). The pool profile, when the page has one, is kept as
        the prior that the first measurement corrects."""
        now_s = time.monotonic() if now_s is None else now_s
        previous_busy = max(self.num_running, self.in_flight_at_scrape)
        self.num_running = sample.num_running or 0.0
        self.num_waiting = sample.num_waiting or 0.0
        self.kv_usage = sample.kv_usage or 0.0
        self.profile = sample.profile
        self.lora = sample.lora
        self.model_names = sample.model_names
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
        batch = max(1.0, (previous_busy + busy) / 2)
        speed = new_tokens / (now_s - last[0]) / batch
        previous = self.decode_speed
        if previous is None and self.profile is not None:
            # Start the average from the prior (at the batch measured), not from this first sample: one short
            # interval is the noisiest reading there is (a prefill inside it reads as a stall, speed 0), and
            # the prior is the best estimate held until now; a wrong one fades like any older sample (0.7^k).
            previous = self.profile.tokens_per_s_per_sequence(min(batch, self.profile.max_num_seqs))
        self.decode_speed = speed if previous is None else (
            SPEED_EWMA_WEIGHT * speed + (1 - SPEED_EWMA_WEIGHT) * previous)

    def eject(self, reason: str) -> bool:
        """Stop sending it traffic until a /ready probe passes; True if it was taking traffic."""
        was_ready, self.ready, self.ejected_reason = self.ready, False, reason
        self._last_tokens = None
        return was_ready

    def restore(self) -> None:
        self.ready, self.ejected_reason = True, None
