"""Foresight: the demand a poll would plan for if it knew the future, to bound what a better forecast can buy.

The optimizer control plans for Holt's forecast of the measured rate one lead time ahead (fleet/forecast.py). An
oracle run replaces only that forecast: at each poll it plans for the highest arrival rate the coming lead time
will see (the arrivals of the day's request list, counted over sliding windows of `window_s`), with the day's
true token mix; everything else (the optimizer, the capacity model, the stabilization windows, cold starts, the
router) is the same code. The cheapest oracle run within the SLO is then a floor under what any forecast can
reach with this capacity model: the optimizer's remaining cost gap to a target splits into what forecasting could
still win (down to the oracle) and what it cannot (below it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .workloads import Request

WINDOW_S = 60.0  # the rate is a count over this long: a poll's rate is noisy over 15 s, a day's shape is not


class Foresight:
    def __init__(self, requests: Sequence[Request], window_s: float = WINDOW_S):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.arrivals = sorted(r.arrival_s for r in requests)
        n = max(len(requests), 1)
        self.mean_prompt_tokens = sum(r.prompt_tokens for r in requests) / n
        self.mean_output_tokens = sum(r.output_tokens for r in requests) / n

    def rate(self, start_s: float, end_s: float) -> float:
        """Arrivals per second over [start_s, end_s)."""
        count = bisect.bisect_left(self.arrivals, end_s) - bisect.bisect_left(self.arrivals, start_s)
        return count / (end_s - start_s)

    def peak_rate(self, now_s: float, lead_s: float) -> float:
        """The highest windowed rate from now to `lead_s` ahead (windows stepped by a quarter of their length)."""
        step = self.window_s / 4
        starts = [now_s + i * step for i in range(int(max(lead_s, 0.0) // step) + 1)]
        return max(self.rate(s, s + self.window_s) for s in starts)
