"""When speculation pays, and how many tokens each request speculates.

Per request (`next_num_draft_tokens`): after a verification, all drafts accepted -> one more next time (up
to num_speculative_tokens); some rejected -> as many as were accepted plus one. A request whose proposals
keep failing drops to one draft per step, and climbs back as they start to match.

Per step (`SpeculationPolicy.should_speculate`): a step's time grows with its token count once the model's
matmuls stop being memory-bound; verifying D drafts among B decodes turns a step of B tokens into one of
B + D tokens that yields B + A tokens (A accepted). So speculation runs while
    t(B + D) / (B + A) < t(B) / B,
with A = D x the recent acceptance rate and t() the engine's own measured step-time curve (`StepTimes`: a
running mean per token-count bucket, interpolated; any step counts, prefill chunks included, so the curve
is one of tokens per step, whatever their kind). While t(B) is unknown the step runs plain, which measures
it; past the largest measured step t(B + D) is extrapolated from the two largest; with fewer points it
speculates, which measures them. A bucket unmeasured for _MAX_AGE_STEPS steps is forgotten, so a decision
taken under other load is revisited.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Token-count buckets: exact at the small counts a decode batch has, then ~x1.5 steps.
_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
            224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096, 8192)  # fmt: skip
_SMOOTHING = 0.1  # weight of a new measurement in its bucket's mean
_MIN_SAMPLES = 3  # measurements before a bucket's mean is believed
# A bucket not measured for this many steps starts over: the machine's load may have changed since, and a
# stale slow mean would otherwise keep speculation off (and so unmeasured) for good. Starting over costs a few
# exploratory steps per this many.
_MAX_AGE_STEPS = 2000


def next_num_draft_tokens(num_drafted: int, num_accepted: int, current: int, maximum: int) -> int:
    """The request's draft length for its next step, from how its last verification went."""
    if num_drafted == 0:
        return current
    if num_accepted == num_drafted:
        return min(current + 1, maximum)
    return max(1, min(current, num_accepted + 1))


class StepTimes:
    """The measured step-time curve: seconds per step against the tokens computed in it."""

    def __init__(self) -> None:
        self._tokens = [0.0] * len(_BUCKETS)  # mean token count in each bucket
        self._seconds = [0.0] * len(_BUCKETS)
        self._counts = [0] * len(_BUCKETS)
        self._last_step = [0] * len(_BUCKETS)  # when each bucket was last measured
        self._num_steps = 0

    def record(self, num_tokens: int, seconds: float) -> None:
        self._num_steps += 1
        i = min(bisect.bisect_left(_BUCKETS, num_tokens), len(_BUCKETS) - 1)
        self._last_step[i] = self._num_steps
        self._counts[i] += 1
        weight = max(_SMOOTHING, 1.0 / self._counts[i])
        self._tokens[i] += weight * (num_tokens - self._tokens[i])
        self._seconds[i] += weight * (seconds - self._seconds[i])

    def points(self) -> list[tuple[float, float]]:
        """(tokens, seconds) of the believed buckets, by token count; a stale bucket is forgotten here."""
        for i, last in enumerate(self._last_step):
            if self._counts[i] and self._num_steps - last > _MAX_AGE_STEPS:
                self._counts[i], self._tokens[i], self._seconds[i] = 0, 0.0, 0.0
        return [(t, s) for t, s, c in zip(self._tokens, self._seconds, self._counts, strict=True)
                if c >= _MIN_SAMPLES]  # fmt: skip

    def estimate(self, num_tokens: int, extrapolate: bool = False) -> float | None:
        """Seconds for a step of `num_tokens`, interpolated between the measured points around it. Past the
        largest point, with `extrapolate`, along the line through the two largest (never falling); else
        None, as when nothing at or below it was measured."""
        points = self.points()
        below = [p for p in points if p[0] <= num_tokens]
        above = [p for p in points if p[0] >= num_tokens]
        if extrapolate and not above and len(below) >= 2:
            above = [below[-1]]
            (t0, s0), (t1, s1) = below[-2], below[-1]
            return s1 + max(0.0, (s1 - s0) / (t1 - t0)) * (num_tokens - t1)
        if not below or not above:
            return None
        (t0, s0), (t1, s1) = below[-1], above[0]
        if t1 == t0:
            return s0
        return s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)


@dataclass
class AcceptanceStats:
    """Cumulative draft counts, as vLLM's spec_decode metrics report them."""

    num_drafts: int = 0  # verifications (requests x steps with at least one draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None  # [k]: drafts accepted at each position

    def record(self, num_drafted: int, num_accepted: int, max_positions: int) -> None:
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * max_positions
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def as_engine_stats(self) -> dict:
        """EngineStats' spec_* fields."""
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(self.accepted_per_pos or ())}  # fmt: skip

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class SpeculationPolicy:
    """The engine-wide switch: speculate this step or not (owned by the scheduler)."""

    def __init__(self, disable_by_batch_size: int | None = None) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.step_times = StepTimes()
        self.stats = AcceptanceStats()
        self._recent_rate = 0.5  # running acceptance rate, recent verifications weigh most

    @property
    def recent_acceptance_rate(self) -> float:
        return self._recent_rate

    def record_verification(self, num_drafted: int, num_accepted: int, max_positions: int) -> None:
        self.stats.record(num_drafted, num_accepted, max_positions)
        self._recent_rate += 0.05 * (num_accepted / num_drafted - self._recent_rate)

    def should_speculate(self, num_decodes: int, num_draft_tokens: int) -> bool:
        """Whether a step of `num_decodes` decodes gains from verifying `num_draft_tokens` more tokens."""
        if self.disable_by_batch_size is not None:  # the user's own rule replaces the measured one
            return num_decodes <= self.disable_by_batch_size
        if num_decodes == 0 or num_draft_tokens == 0:
            return num_draft_tokens > 0
        plain = self.step_times.estimate(num_decodes)
        speculative = self.step_times.estimate(num_decodes + num_draft_tokens, extrapolate=True)
        if plain is None:
            return False  # measure the plain step first
        if speculative is None:
            return True
        expected_tokens = num_decodes + self._recent_rate * num_draft_tokens
        return speculative / expected_tokens < plain / num_decodes
