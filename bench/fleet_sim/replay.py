"""Replay an explicit request list against N simulated replicas, for calibrating the simulator against a real run.

    from bench.fleet_sim.replay import replay, backend
    from bench.fleet_sim.workloads import Request
    summary = replay([Request(0.0, 512, 128), Request(0.5, 256, 64)],
                     [backend(alpha_s=0.0194, beta_s=0.00222, prefill_tokens_per_s=760, kv_tokens=16384)] * 2)

The requests go through the real router policy (capacity-aware by default, `strategy="round-robin"` for the
Service-like baseline) to replicas that never scale. The answer has bench/loadgen.py's `summarize` keys and units
for the same workload, so a real two-backend run (loadgen against `hpi router` in front of two `hpi serve`
pinned to their own cores, each profiled with `hpi profile`) and its simulation can be set side by side:
requests_per_s, output_tokens_per_s, ttft_ms, tpot_ms, itl_ms, e2e_ms (p50/p90/p99). One difference: the
simulator has each request's mean inter-token gap, not every gap, so its itl_ms is the percentiles of the
per-request means (the same figures as tpot_ms). `duration_s` runs from the first arrival to the last finish.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpi_operator.fleet.performance import PoolPerformance

from .engine import RunConfig, Simulation
from .metrics import percentiles
from .pools import SimPool
from .replica import EngineShape
from .scaling import FixedControl
from .workloads import Request


def backend(alpha_s: float, beta_s: float, prefill_tokens_per_s: float, kv_tokens: int, max_num_seqs: int = 64,
            max_num_batched_tokens: int = 2048) -> EngineShape:  # fmt: skip
    """One replica from a profile's figures (`hpi profile` prints them) and the engine's limits (hpi's defaults)."""
    perf = PoolPerformance(alpha_s, beta_s, prefill_tokens_per_s, max_num_seqs, source="measured")
    return EngineShape(perf, kv_tokens, max_num_seqs, max_num_batched_tokens)


def replay(requests: Sequence[Request], backends: Sequence[EngineShape], strategy: str = "load",
           scrape_interval_s: float | None = None) -> dict:  # fmt: skip
    """Run `requests` (sorted by arrival) on `backends` (one replica each); loadgen-shaped figures."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    pools = [SimPool(f"backend-{i}", None, shape, 0.0, 1, 0.0) for i, shape in enumerate(backends)]
    replicas = {p.name: 1 for p in pools}
    end_s = ordered[-1].arrival_s if ordered else 0.0
    config = RunConfig(pools=pools, requests=ordered, control=FixedControl(replicas), initial_replicas=replicas,
                       duration_s=end_s, strategy=strategy, scrape_interval_s=scrape_interval_s)  # fmt: skip
    run = Simulation(config).run()
    results = sorted(run.results, key=lambda r: r.request_id)
    start = ordered[0].arrival_s if ordered else 0.0
    duration = max((r.arrival_s + r.e2e_s for r in results), default=start) - start
    num_output = sum(r.output_tokens for r in results)
    tpot = [r.mean_itl_s for r in results if r.output_tokens > 1]
    return {
        "num_requests": len(ordered),
        "num_errors": run.num_unserved,
        "duration_s": duration,
        "requests_per_s": len(results) / duration if duration else 0.0,
        "output_tokens_per_s": num_output / duration if duration else 0.0,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in results) / max(1, len(results)),
        "mean_output_tokens": num_output / max(1, len(results)),
        "ttft_ms": _ms(percentiles([r.ttft_s for r in results])),
        "itl_ms": _ms(percentiles(tpot)),
        "tpot_ms": _ms(percentiles(tpot)),
        "e2e_ms": _ms(percentiles([r.e2e_s for r in results])),
        "per_request": [
            {"ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "mean_itl_s": r.mean_itl_s, "backend": r.pool} for r in results
        ],  # fmt: skip
    }


def _ms(values: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else v * 1e3 for k, v in values.items()}
