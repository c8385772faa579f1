"""Reading the runtime pods' KV-cache load: which pods to ask (pure, from the Pod objects), and an async scrape
of each one's /metrics (aiohttp, prometheus_client's text parser) into a per-pod result.

Only the names in hpi_contracts.metrics are read. They are vLLM's, so stock vLLM pods scrape the same way. A pod
that does not answer, answers badly, or lacks the KV gauge is a `ScrapeFailed`, never a zero load.
"""

from __future__ import annotations

import asyncio
import datetime
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts.metrics import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    MODEL_NAME_LABEL,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    REQUEST_TIME_PER_OUTPUT_TOKEN,
    STARTUP_PHASE_SECONDS,
    STARTUP_SECONDS,
    TIME_TO_FIRST_TOKEN,
)

from ..names import LABEL_POOL, RUNTIME_PORT, RUNTIME_PORT_NAME
from .decision import Buckets, Observation, PodLoad

DEFAULT_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 4 * 1024 * 1024  # a runtime's /metrics is tens of KiB; anything huge is not one
UNREACHABLE, UNPARSABLE = "unreachable", "unparsable"


@dataclass(frozen=True)
class PodTarget:
    pod: str
    url: str  # http://<podIP>:<port>/metrics
    pool: str | None = None  # the node pool it serves (its serving.hpi.dev/pool label)
    start_s: float | None = None  # creation to Ready, for a pod none of whose containers restarted (cold_start_s)


@dataclass(frozen=True)
class Scraped:
    pod: str
    load: PodLoad


@dataclass(frozen=True)
class ScrapeFailed:
    pod: str
    kind: str  # unreachable | unparsable
    detail: str


ScrapeResult = Scraped | ScrapeFailed


class MetricsParseError(ValueError):
    pass


# -- which pods ---------------------------------------------------------------------------------------------


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _metrics_port(pod: Mapping[str, Any], default_port: int) -> int:
    """The container port named `http` (the runtime's and the router's), else the Prometheus annotation, else
    `default_port`."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == RUNTIME_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    annotated = ((pod.get("metadata") or {}).get("annotations") or {}).get("prometheus.io/port")
    return int(annotated) if annotated and str(annotated).isdigit() else default_port


def _time(text: Any) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def cold_start_s(pod: Mapping[str, Any]) -> float | None:
    """How long a ready pod took to serve: from its creation (scheduling, image pull, weights, warm-up) to its
    Ready condition. None when a container restarted or the pod went unready since: its Ready time then dates a
    recovery, not a start."""
    status = pod.get("status") or {}
    if any(c.get("restartCount") for c in status.get("containerStatuses") or []):
        return None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    created = _time((pod.get("metadata") or {}).get("creationTimestamp"))
    became = _time((ready or {}).get("lastTransitionTime"))
    if created is None or became is None or became < created:
        return None
    return (became - created).total_seconds()


def _pod_running(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and not (pod.get("metadata") or {}).get("deletionTimestamp")


def ready_pod_targets(pods: Iterable[Mapping[str, Any]], default_port: int = RUNTIME_PORT) -> list[PodTarget]:
    """The pods that serve traffic (Running, Ready, not terminating, with an IP), as scrape targets."""
    return _targets(pods, default_port, _pod_ready)


def running_pod_targets(pods: Iterable[Mapping[str, Any]], default_port: int = RUNTIME_PORT) -> list[PodTarget]:
    """The pods that run (Running, not terminating, with an IP), ready or not: a sleeping runtime is not ready
    and must still be found to be woken (sleep.py)."""
    return _targets(pods, default_port, _pod_running)


def _targets(pods: Iterable[Mapping[str, Any]], default_port: int,
             include: Callable[[Mapping[str, Any]], bool]) -> list[PodTarget]:  # fmt: skip
    targets = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip and include(pod):
            host = f"[{ip}]" if ":" in ip else ip
            pool = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_POOL)
            url = f"http://{host}:{_metrics_port(pod, default_port)}/metrics"
            targets.append(PodTarget(pod["metadata"]["name"], url, pool, cold_start_s(pod)))
    return sorted(targets, key=lambda t: t.pod)


# -- parsing ------------------------------------------------------------------------------------------------

# The counters the fleet optimizer reads its demand from, as prometheus-client names their samples.
_COUNTERS = (f"{REQUEST_SUCCESS}_total", f"{PROMPT_TOKENS}_total", f"{GENERATION_TOKENS}_total")
# The histograms its observed SLO attainment is read from, by their bucket samples' name.
_HISTOGRAMS = (f"{TIME_TO_FIRST_TOKEN}_bucket", f"{REQUEST_TIME_PER_OUTPUT_TOKEN}_bucket")


def _buckets(counts: dict[float, float]) -> Buckets | None:
    """Bucket samples (several per bound when a pod serves several models: summed) -> cumulative buckets; None
    when there is no +Inf bucket or a count is not a finite, non-negative, non-decreasing number (a histogram
    that reads badly is left out of the attainment, never a failed scrape: the KV load is still good)."""
    buckets = tuple(sorted(counts.items()))
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    values = [count for _, count in buckets]
    if not all(math.isfinite(v) and v >= 0 for v in values) or values != sorted(values):
        return None
    return buckets


def parse_load(pod: str, text: str, model_name: str | None = None) -> PodLoad:
    """A pod's /metrics text -> its load; samples of other models are ignored when `model_name` is given.

    Several samples of one gauge (several engines or models in one pod) are averaged for the KV fraction and
    summed for the request counts. Raises MetricsParseError when the text is not Prometheus exposition format
    or the KV gauge is missing or not a finite number in [0, 1].
    """
    values: dict[str, list[float]] = {KV_CACHE_USAGE: [], NUM_REQUESTS_WAITING: [], NUM_REQUESTS_RUNNING: [],
                                      **{name: [] for name in _COUNTERS}}  # fmt: skip
    histograms: dict[str, dict[float, float]] = {name: {} for name in _HISTOGRAMS}
    startup: dict[str, float] = {}  # phase -> seconds; STARTUP_SECONDS under its own name
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (STARTUP_PHASE_SECONDS, STARTUP_SECONDS):
                    value = float(sample.value)  # informative only: a bad value is dropped, never a failed scrape
                    if math.isfinite(value) and value >= 0:
                        startup[sample.labels.get("phase", STARTUP_SECONDS)] = value
                    continue
                if sample.name not in values and sample.name not in histograms:
                    continue
                if model_name is not None and sample.labels.get(MODEL_NAME_LABEL, model_name) != model_name:
                    continue
                if sample.name in histograms:
                    le = float(sample.labels["le"])
                    histograms[sample.name][le] = histograms[sample.name].get(le, 0.0) + float(sample.value)
                    continue
                values[sample.name].append(float(sample.value))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise MetricsParseError(f"not Prometheus text: {e}") from e
    kv = values[KV_CACHE_USAGE]
    if not kv:
        raise MetricsParseError(f"no {KV_CACHE_USAGE} sample")
    numbers = [v for vs in values.values() for v in vs]
    if not all(math.isfinite(v) for v in numbers) or not all(0.0 <= v <= 1.0 for v in kv):
        raise MetricsParseError(f"{KV_CACHE_USAGE} or a request gauge is not a finite fraction/count: {numbers}")
    finished, prompt, generation = (sum(values[n]) if values[n] else None for n in _COUNTERS)
    return PodLoad(
        pod=pod,
        kv_utilization=sum(kv) / len(kv),
        num_waiting=sum(values[NUM_REQUESTS_WAITING]),
        num_running=sum(values[NUM_REQUESTS_RUNNING]),
        num_finished=finished,
        prompt_tokens=prompt,
        generation_tokens=generation,
        ttft_buckets=_buckets(histograms[_HISTOGRAMS[0]]),
        tpot_buckets=_buckets(histograms[_HISTOGRAMS[1]]),
        startup_phases=tuple((p, s) for p, s in startup.items() if p != STARTUP_SECONDS),
        startup_s=startup.get(STARTUP_SECONDS),
    )


# -- scraping -----------------------------------------------------------------------------------------------


async def fetch_metrics(session: aiohttp.ClientSession, target: PodTarget, timeout_s: float) -> str | ScrapeFailed:
    """A pod's /metrics text, or why there is none (shared by the runtime and the router scrapes)."""
    try:
        async with session.get(target.url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return ScrapeFailed(target.pod, UNREACHABLE, f"HTTP {response.status} from {target.url}")
            body = await response.content.read(MAX_BODY_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return ScrapeFailed(target.pod, UNREACHABLE, f"{type(e).__name__} from {target.url}: {e}")
    if len(body) > MAX_BODY_BYTES:
        return ScrapeFailed(target.pod, UNPARSABLE, f"/metrics larger than {MAX_BODY_BYTES} bytes")
    try:
        return body.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        return ScrapeFailed(target.pod, UNPARSABLE, str(e))


async def scrape_pod(
    session: aiohttp.ClientSession, target: PodTarget, timeout_s: float, model_name: str | None = None
) -> ScrapeResult:
    text = await fetch_metrics(session, target, timeout_s)
    if isinstance(text, ScrapeFailed):
        return text
    try:
        return Scraped(target.pod, parse_load(target.pod, text, model_name))
    except MetricsParseError as e:
        return ScrapeFailed(target.pod, UNPARSABLE, str(e))


async def scrape_pods(
    targets: Sequence[PodTarget],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    model_name: str | None = None,
    session: aiohttp.ClientSession | None = None,
) -> list[ScrapeResult]:
    """Scrape every target concurrently; one result per target, in the targets' order."""
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await scrape_pods(targets, timeout_s, model_name, own)
    return list(await asyncio.gather(*(scrape_pod(session, t, timeout_s, model_name) for t in targets)))


def observation(results: Iterable[ScrapeResult], num_external_waiting: int = 0) -> Observation:
    results = list(results)
    return Observation(
        loads=tuple(r.load for r in results if isinstance(r, Scraped)),
        num_failed=sum(isinstance(r, ScrapeFailed) for r in results),
        num_external_waiting=num_external_waiting,
    )


def startup_by_pool(results: Iterable[ScrapeResult], targets: Iterable[PodTarget]) -> dict[str, Any] | None:
    """How the ready pods of each pool started, from their own /metrics (hpi_runtime/startup.py): the slowest
    pod's total and each phase's slowest, with the number of pods that reported; None when none did."""
    pool_of = {t.pod: t.pool for t in targets if t.pool}
    out: dict[str, Any] = {}
    for result in results:
        load = result.load if isinstance(result, Scraped) else None
        pool = pool_of.get(result.pod)
        if load is None or pool is None or (load.startup_s is None and not load.startup_phases):
            continue
        entry = out.setdefault(pool, {"pods": 0, "totalSeconds": None, "phases": {}})
        entry["pods"] += 1
        if load.startup_s is not None:
            entry["totalSeconds"] = round(max(entry["totalSeconds"] or 0.0, load.startup_s), 2)
        for phase, seconds in load.startup_phases:
            entry["phases"][phase] = round(max(entry["phases"].get(phase, 0.0), seconds), 2)
    return dict(sorted(out.items())) or None
