"""The demand the optimizer plans for, from the runtime pods' own counters: finished requests, prompt tokens and
generated tokens (vLLM's `request_success`, `prompt_tokens`, `generation_tokens`), read at each poll; the
demand is their growth since the previous poll, summed over pods. A pod seen for the first time, or whose
counters went back (it restarted), contributes from zero at the next poll.

The request rate counts arrivals, not completions: the finished requests plus the growth of the requests still
in the pod (vLLM's `num_requests_running` + `num_requests_waiting`). Completions lag arrivals by a request's
duration, so on a rising day a rate of completions is always one request-duration late; the token mix still
comes from finished requests (an unfinished one has no output count yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..autoscaling.decision import PodLoad
from .performance import Demand

# Before anything finished: a chat-sized mix, only ever used to price a demand of zero requests.
DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS = 512.0, 256.0

# finished requests, prompt tokens, generation tokens, requests in the pod (running + waiting)
Counters = tuple[float, float, float, float]


@dataclass(frozen=True)
class DemandReading:
    demand: Demand
    counters: Mapping[str, Counters]  # per pod, to diff against at the next poll
    measured: bool  # False on the first poll (nothing to diff against yet)


def read_demand(
    loads: Sequence[PodLoad],
    previous: Mapping[str, Counters],
    previous_at_s: float | None,
    now_s: float,
    previous_mix: tuple[float, float] | None = None,
) -> DemandReading:
    """Requests per second and the token mix between the previous poll and now."""
    counters: dict[str, Counters] = {}
    finished = prompt = generated = arrived = 0.0
    for load in loads:
        if load.num_finished is None or load.prompt_tokens is None or load.generation_tokens is None:
            continue
        in_pod = load.num_running + load.num_waiting
        now = (load.num_finished, load.prompt_tokens, load.generation_tokens, in_pod)
        counters[load.pod] = now
        before = previous.get(load.pod)
        if before is None or any(n < b for n, b in zip(now[:3], before[:3], strict=True)):
            continue  # new or restarted: its growth starts now
        finished += now[0] - before[0]
        prompt += now[1] - before[1]
        generated += now[2] - before[2]
        # An older operator's memory has no in-pod count: count completions for that one poll.
        arrived += now[0] - before[0] + (in_pod - before[3] if len(before) > 3 else 0.0)
    mix = previous_mix or (DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS)
    if finished > 0:
        mix = (prompt / finished, max(generated / finished, 1.0))
    elapsed = now_s - previous_at_s if previous_at_s is not None else 0.0
    rate = max(arrived, 0.0) / elapsed if elapsed > 0 else 0.0
    demand = Demand(request_rate=rate, mean_prompt_tokens=mix[0], mean_output_tokens=max(mix[1], 1.0))
    return DemandReading(demand, counters, measured=previous_at_s is not None and elapsed > 0)
