"""Seeded request streams for the fleet simulator: when requests arrive and how many tokens each carries.

Arrivals: Poisson at a fixed rate, a bursty two-state Markov-modulated Poisson process (MMPP: calm and burst
phases with exponential sojourns), and a diurnal day compressed into the run (a non-homogeneous Poisson
process, drawn by thinning, whose rate follows one cosine period from the night trough to the midday peak).

Token lengths: lognormals fitted to the statistics published for the Azure LLM inference traces 2023
(github.com/Azure/AzurePublicDataset, AzureLLMInferenceDataset2023.md: the traces of the ISCA 2024 paper
"Splitwise: Efficient generative LLM inference using phase splitting", Patel et al., arXiv 2311.18677):
- conversation: median 1020 prompt tokens and 129 output tokens (Splitwise, section III "Workload
  characterization"); means about 1155 and 211 from the dataset's notebook;
- code: median 1500 prompt tokens and 13 output tokens; means about 2048 and 28.
A lognormal with median m and mean u has mu = ln m and sigma = sqrt(2 ln(u / m)). Provenance, plainly: the
search in this session found the dataset's README (which names the Splitwise paper as its analysis) but neither
the traces (they cannot be downloaded here) nor the figures themselves; the medians are the paper's as
recalled, the means as recalled from the dataset's notebook. Treat the fit as unverified until someone with the
CSVs checks it (a two-line pandas describe()). Draws are clipped to the stated maxima.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output token counts, each lognormal (sigma 0 makes it fixed at the median)."""

    name: str
    prompt_median: float
    prompt_mean: float
    output_median: float
    output_mean: float
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 2048

    @property
    def prompt_sigma(self) -> float:
        return math.sqrt(2 * math.log(self.prompt_mean / self.prompt_median))

    @property
    def output_sigma(self) -> float:
        return math.sqrt(2 * math.log(self.output_mean / self.output_median))

    def sample(self, rng: random.Random) -> tuple[int, int]:
        prompt = rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma)
        output = rng.lognormvariate(math.log(self.output_median), self.output_sigma)
        return (max(1, min(self.max_prompt_tokens, round(prompt))),
                max(1, min(self.max_output_tokens, round(output))))  # fmt: skip

    def mean_tokens(self) -> tuple[float, float]:
        """The lognormals' means (before clipping): what the optimizer's first plan assumes."""
        return self.prompt_mean, self.output_mean


AZURE_CONV_2023 = LengthMix("azure-conv-2023", prompt_median=1020, prompt_mean=1155, output_median=129,
                            output_mean=211)  # fmt: skip
AZURE_CODE_2023 = LengthMix("azure-code-2023", prompt_median=1500, prompt_mean=2048, output_median=13,
                            output_mean=28)  # fmt: skip


def fixed_mix(prompt_tokens: int, output_tokens: int) -> LengthMix:
    return LengthMix(f"fixed-{prompt_tokens}-{output_tokens}", prompt_tokens, prompt_tokens, output_tokens,
                     output_tokens)  # fmt: skip


@dataclass(frozen=True)
class Arrivals:
    """When requests come. `rate_rps` is the mean (poisson, mmpp) or the peak (diurnal)."""

    kind: str  # poisson | mmpp | diurnal
    rate_rps: float
    duration_s: float
    trough_fraction: float = 0.2  # diurnal: the night's rate as a fraction of the peak
    burst_factor: float = 3.0  # mmpp: burst rate / calm rate
    mean_calm_s: float = 60.0  # mmpp: mean sojourn in each phase
    mean_burst_s: float = 15.0

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "mmpp", "diurnal"):
            raise ValueError(f"unknown arrival process {self.kind!r} (poisson, mmpp, diurnal)")
        if self.rate_rps <= 0 or self.duration_s <= 0:
            raise ValueError("rate_rps and duration_s must be > 0")

    def diurnal_rate(self, t_s: float) -> float:
        """Night at the start and the end of the run, the peak in the middle."""
        phase = 0.5 * (1 - math.cos(2 * math.pi * t_s / self.duration_s))
        return self.rate_rps * (self.trough_fraction + (1 - self.trough_fraction) * phase)


def _times(arrivals: Arrivals, rng: random.Random) -> Iterator[float]:
    t = 0.0
    if arrivals.kind == "poisson":
        while True:
            t += rng.expovariate(arrivals.rate_rps)
            yield t
    elif arrivals.kind == "diurnal":
        while True:  # thinning: candidates at the peak rate, each kept with probability rate(t) / peak
            t += rng.expovariate(arrivals.rate_rps)
            if rng.random() * arrivals.rate_rps <= arrivals.diurnal_rate(t):
                yield t
    else:
        # Calm and burst rates chosen so that the long-run mean is rate_rps.
        calm_share = arrivals.mean_calm_s / (arrivals.mean_calm_s + arrivals.mean_burst_s)
        calm = arrivals.rate_rps / (calm_share + (1 - calm_share) * arrivals.burst_factor)
        burst, phase_end = False, rng.expovariate(1 / arrivals.mean_calm_s)
        while True:
            rate = calm * arrivals.burst_factor if burst else calm
            step = rng.expovariate(rate)
            if t + step > phase_end:  # memoryless: restart the draw at the phase change
                t, burst = phase_end, not burst
                phase_end = t + rng.expovariate(1 / (arrivals.mean_burst_s if burst else arrivals.mean_calm_s))
                continue
            t += step
            yield t


def generate(arrivals: Arrivals, mix: LengthMix, seed: int) -> list[Request]:
    """The whole request list for one run: the same seed gives the same list."""
    rng = random.Random(seed)
    requests = []
    for t in _times(arrivals, rng):
        if t >= arrivals.duration_s:
            break
        prompt, output = mix.sample(rng)
        requests.append(Request(t, prompt, output))
    return requests
