"""The demand the optimizer plans for, from the runtime pods' own counters: finished requests, prompt tokens and
generated tokens (vLLM's `request_success`, `prompt_tokens`, `generation_tokens`), read at each poll; the
demand is their growth since the previous poll, summed over pods. A pod seen for the first time, or whose
counters went back (it restarted), contributes from zero at the next poll.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..autoscaling.decision import PodLoad
from .performance import Demand

# Before anything finished: a chat-sized mix, only ever used to price a demand of zero requests.
DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS = 512.0, 256.0

Counters = tuple[float, float, float]  # finished requests, prompt tokens, generation tokens


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
    finished = prompt = generated = 0.0
    for load in loads:
        if load.num_finished is None or load.prompt_tokens is None or load.generation_tokens is None:
            continue
        now = (load.num_finished, load.prompt_tokens, load.generation_tokens)
        counters[load.pod] = now
        before = previous.get(load.pod)
        if before is None or any(n < b for n, b in zip(now, before, strict=True)):
            continue  # new or restarted: its growth starts now
        finished += now[0] - before[0]
        prompt += now[1] - before[1]
        generated += now[2] - before[2]
    mix = previous_mix or (DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS)
    if finished > 0:
        mix = (prompt / finished, max(generated / finished, 1.0))
    elapsed = now_s - previous_at_s if previous_at_s is not None else 0.0
    rate = finished / elapsed if elapsed > 0 else 0.0
    demand = Demand(request_rate=rate, mean_prompt_tokens=mix[0], mean_output_tokens=max(mix[1], 1.0))
    return DemandReading(demand, counters, measured=previous_at_s is not None and elapsed > 0)
