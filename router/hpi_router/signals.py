"""A backend's load signals from its Prometheus text (vLLM's metric names, hpi_contracts.metrics), parsed with
prometheus_client.

Only the few families the router reads are handed to the parser (the rest of the page, histograms mostly,
is dropped by a cheap line filter first), so a scrape costs well under a millisecond of router CPU.

The pool profile a pod was started with (`hpi serve --pool-profile`, exported as `hpi:profile_*` gauges) comes
along as a `PoolProfile`: the router's prior for the backend's speed until it has measured one.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts.metrics import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROFILE_GAUGES,
    PROFILE_ITL_ALPHA,
    PROFILE_ITL_BETA,
    PROFILE_MAX_NUM_SEQS,
    PROFILE_PREFILL_RATE,
    READ_BY_ROUTER,
    READY,
    total,
)
from hpi_contracts.pool_profile import SOURCES, PoolProfile

GENERATION_TOKENS_SAMPLE = total(GENERATION_TOKENS)  # a counter's samples carry _total


@dataclass(frozen=True)
class ScrapeSample:
    """One scrape. Fields are None where the backend does not export the metric (a non-hpi server)."""

    num_running: float | None
    num_waiting: float | None
    kv_usage: float | None
    generation_tokens: float | None
    ready: bool | None
    profile: PoolProfile | None = None  # None when the page has no complete, valid set of profile gauges


def _wanted(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) > 2 and parts[2] in READ_BY_ROUTER
    return line.startswith(READ_BY_ROUTER)


def _profile(values: dict[str, float], source: str | None) -> PoolProfile | None:
    """The profile gauges -> PoolProfile; None if one is missing or the figures are not a valid profile (a prior
    the router cannot trust is no prior: it measures instead)."""
    if any(name not in values for name in PROFILE_GAUGES) or source not in SOURCES:
        return None
    seqs = values[PROFILE_MAX_NUM_SEQS]
    if seqs != int(seqs):
        return None
    try:
        return PoolProfile(values[PROFILE_ITL_ALPHA] * 1000, values[PROFILE_ITL_BETA] * 1000,
                           values[PROFILE_PREFILL_RATE], int(seqs), source)
    except ValueError:
        return None


def parse_metrics(text: str) -> ScrapeSample:
    """Prometheus text -> the signals, summed over label sets (a server may serve several model names)."""
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    profile: dict[str, float] = {}
    source: str | None = None
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            if sample.name in PROFILE_GAUGES:  # one profile per pod, repeated per model name: not summed
                profile[sample.name] = sample.value
                source = sample.labels.get("source")
            elif sample.name == KV_CACHE_USAGE:  # a fraction: the fullest cache is the one that matters
                sums[sample.name] = max(sums.get(sample.name, 0.0), sample.value)
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    ready = sums.get(READY)
    return ScrapeSample(
        num_running=sums.get(NUM_REQUESTS_RUNNING),
        num_waiting=sums.get(NUM_REQUESTS_WAITING),
        kv_usage=sums.get(KV_CACHE_USAGE),
        generation_tokens=sums.get(GENERATION_TOKENS_SAMPLE),
        ready=None if ready is None else ready > 0,
        profile=_profile(profile, source),
    )
