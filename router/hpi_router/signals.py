"""A backend's load signals from its Prometheus text (vLLM's metric names, hpi_contracts.metrics), parsed with
prometheus_client.

Only the few families the router reads are handed to the parser (the rest of the page, histograms mostly,
is dropped by a cheap line filter first), so a scrape costs well under a millisecond of router CPU.

The LoRA adapters a backend has requests for (vLLM's `vllm:lora_requests_info`: running and waiting adapters, and
max_lora) come along as `LoraState`: an adapter with requests there is resident in its batch, so another request
for it joins at no cost (the router's adapter affinity, pool.py).

The pool profile a pod was started with (`hpi serve --pool-profile`, exported as `hpi:profile_*` gauges) comes
along as a `PoolProfile`: the router's prior for the backend's speed until it has measured one.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts.metrics import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    LORA_REQUESTS_INFO,
    MAX_LORA_LABEL,
    MODEL_NAME_LABEL,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROFILE_GAUGES,
    PROFILE_ITL_ALPHA,
    PROFILE_ITL_BETA,
    PROFILE_MAX_NUM_SEQS,
    PROFILE_PREFILL_RATE,
    PROFILE_SLO_MAX_NUM_SEQS,
    READ_BY_ROUTER,
    READY,
    RUNNING_LORA_ADAPTERS_LABEL,
    WAITING_LORA_ADAPTERS_LABEL,
    total,
)
from hpi_contracts.pool_profile import SOURCES, PoolProfile

GENERATION_TOKENS_SAMPLE = total(GENERATION_TOKENS)  # a counter's samples carry _total


@dataclass(frozen=True)
class LoraState:
    """A backend's adapters in use: those with requests running or waiting there, and how many one batch holds."""

    active: frozenset[str]
    max_loras: int


@dataclass(frozen=True)
class ScrapeSample:
    """One scrape. Fields are None where the backend does not export the metric (a non-hpi server)."""

    num_running: float | None
    num_waiting: float | None
    kv_usage: float | None
    generation_tokens: float | None
    ready: bool | None
    profile: PoolProfile | None = None  # None when the page has no complete, valid set of profile gauges
    lora: LoraState | None = None  # None without the LoRA gauge (LoRA off, or a server without it)
    model_names: frozenset[str] = frozenset()  # the base model's served names (the samples' model_name labels)


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
    seqs, slo_seqs = values[PROFILE_MAX_NUM_SEQS], values.get(PROFILE_SLO_MAX_NUM_SEQS)
    if seqs != int(seqs) or (slo_seqs is not None and slo_seqs != int(slo_seqs)):
        return None
    try:
        return PoolProfile(values[PROFILE_ITL_ALPHA] * 1000, values[PROFILE_ITL_BETA] * 1000,
                           values[PROFILE_PREFILL_RATE], int(seqs), source,
                           None if slo_seqs is None else int(slo_seqs))  # fmt: skip
    except ValueError:
        return None


def _names(labels: dict[str, str], key: str) -> set[str]:
    return {name for name in (labels.get(key) or "").split(",") if name}


def _lora(labels: dict[str, str] | None) -> LoraState | None:
    """The newest `vllm:lora_requests_info` sample's labels -> LoraState (None if max_lora is not a count)."""
    if labels is None:
        return None
    try:
        max_loras = int(labels.get(MAX_LORA_LABEL, ""))
    except ValueError:
        return None
    active = _names(labels, RUNNING_LORA_ADAPTERS_LABEL) | _names(labels, WAITING_LORA_ADAPTERS_LABEL)
    return LoraState(frozenset(active), max_loras)


def parse_metrics(text: str) -> ScrapeSample:
    """Prometheus text -> the signals, summed over label sets (a server may serve several model names)."""
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    profile: dict[str, float] = {}
    source: str | None = None
    lora: tuple[float, dict[str, str]] | None = None  # the newest LoRA state: (its time, its labels)
    names: set[str] = set()
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            if MODEL_NAME_LABEL in sample.labels:
                names.add(sample.labels[MODEL_NAME_LABEL])
            if sample.name == LORA_REQUESTS_INFO:  # states, valued by when they were set: the newest holds
                if lora is None or sample.value >= lora[0]:
                    lora = (sample.value, sample.labels)
            elif sample.name in PROFILE_GAUGES or sample.name == PROFILE_SLO_MAX_NUM_SEQS:  # one per pod: not summed
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
        lora=_lora(None if lora is None else lora[1]),
        model_names=frozenset(names),
    )
