"""A backend's load signals from its Prometheus text (vLLM's metric names, hpi_contracts.metrics), parsed with
prometheus_client.

Only the few families the router reads are handed to the parser (the rest of the page, histograms mostly,
is dropped by a cheap line filter first), so a scrape costs well under a millisecond of router CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts.metrics import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    READ_BY_ROUTER,
    READY,
    total,
)

GENERATION_TOKENS_SAMPLE = total(GENERATION_TOKENS)  # a counter's samples carry _total


@dataclass(frozen=True)
class ScrapeSample:
    """One scrape. Fields are None where the backend does not export the metric (a non-hpi server)."""

    num_running: float | None
    num_waiting: float | None
    kv_usage: float | None
    generation_tokens: float | None
    ready: bool | None


def _wanted(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) > 2 and parts[2] in READ_BY_ROUTER
    return line.startswith(READ_BY_ROUTER)


def parse_metrics(text: str) -> ScrapeSample:
    """Prometheus text -> the signals, summed over label sets (a server may serve several model names)."""
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            if sample.name == KV_CACHE_USAGE:  # a fraction: the fullest cache is the one that matters
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
    )
