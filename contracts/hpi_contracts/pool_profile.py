"""A pool's performance profile as it travels between the parts: how fast one replica of the pool is.

`hpi profile` measures it (the runtime times its own engine); the operator keeps it per pool
(status.pools[].profile, or the spec's override in spec.placement.pools[].performance), plans the fleet with it,
and hands it to the pool's pods as `hpi serve --pool-profile JSON`; each pod exports it as gauges
(hpi_contracts.metrics PROFILE_*), and the router reads them to know a new backend's speed before it has
measured any traffic there. One spelling everywhere: the JSON keys are the CRD's (camelCase), milliseconds for
the decode line ITL = alpha + beta x batch, as llm-d's variant autoscaler fits it.

`source` says where the figures come from: `measured` (hpi profile on the pool's own node kind), `assumed`
(published figures of the part, never shown as measured) or `override` (the spec's own figures).

`sloMaxNumSeqs` (optional) is not a measurement but a plan: the most sequences one replica of the pool runs with
its requests within the deployment's SLO at the fleet's token mix, as the fleet optimizer sizes the pool
(hpi_operator.fleet.performance.replica_capacity). The router spreads load in proportion to it (policy.py), so
each pool runs at the share of its SLO capacity the plan gave it, not as full as its decode speed would allow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SOURCES = ("measured", "assumed", "override")
KEYS = ("itlAlphaMs", "itlBetaMs", "prefillTokensPerSecond", "maxNumSeqs")


@dataclass(frozen=True)
class PoolProfile:
    itl_alpha_ms: float  # decode step with an empty batch: one pass over the weights
    itl_beta_ms: float  # added step time per sequence in the batch
    prefill_tokens_per_s: float
    max_num_seqs: int  # the most sequences the KV cache holds at the profiled context length
    source: str = "measured"
    slo_max_num_seqs: int | None = None  # planned: the most sequences within the SLO (module docstring)

    def __post_init__(self) -> None:
        for name in ("itl_alpha_ms", "itl_beta_ms", "prefill_tokens_per_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.itl_alpha_ms < 0 or self.itl_beta_ms < 0 or self.itl_alpha_ms + self.itl_beta_ms <= 0:
            raise ValueError("itlAlphaMs and itlBetaMs must be >= 0 and not both 0")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefillTokensPerSecond must be > 0, got {self.prefill_tokens_per_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"maxNumSeqs must be >= 1, got {self.max_num_seqs}")
        if self.slo_max_num_seqs is not None and self.slo_max_num_seqs < 1:
            raise ValueError(f"sloMaxNumSeqs must be >= 1, got {self.slo_max_num_seqs}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}; got {self.source!r}")

    def step_ms(self, batch: float) -> float:
        """Decode step time with `batch` sequences running."""
        return self.itl_alpha_ms + self.itl_beta_ms * batch

    def tokens_per_s_per_sequence(self, batch: float) -> float:
        """What one sequence sees while `batch` run: one token per step."""
        return 1000.0 / self.step_ms(max(batch, 1.0))

    def as_json(self) -> dict[str, Any]:
        out = {"itlAlphaMs": self.itl_alpha_ms, "itlBetaMs": self.itl_beta_ms,
               "prefillTokensPerSecond": self.prefill_tokens_per_s, "maxNumSeqs": self.max_num_seqs,
               "source": self.source}  # fmt: skip
        if self.slo_max_num_seqs is not None:
            out["sloMaxNumSeqs"] = self.slo_max_num_seqs
        return out


def profile_from_json(raw: Mapping[str, Any], default_source: str = "measured") -> PoolProfile:
    """The CRD/JSON form -> PoolProfile; a missing key or a bad value is a ValueError naming it."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"a pool profile is an object with {', '.join(KEYS)}; got {type(raw).__name__}")
    missing = [key for key in KEYS if raw.get(key) is None]
    if missing:
        raise ValueError(f"a pool profile needs {', '.join(missing)}")
    try:
        alpha, beta = float(raw["itlAlphaMs"]), float(raw["itlBetaMs"])
        prefill = float(raw["prefillTokensPerSecond"])
        seqs = _whole(raw["maxNumSeqs"], "maxNumSeqs")
        slo_seqs = None if raw.get("sloMaxNumSeqs") is None else _whole(raw["sloMaxNumSeqs"], "sloMaxNumSeqs")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a pool profile's figures must be numbers: {exc}") from None
    return PoolProfile(alpha, beta, prefill, seqs, str(raw.get("source") or default_source), slo_seqs)


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or float(value) != int(float(value)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(float(value))


def parse_pool_profile(text: str) -> PoolProfile:
    """`--pool-profile`'s JSON text -> PoolProfile (ValueError with the reason)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pool-profile is not JSON: {exc}") from None
    return profile_from_json(raw)


def pool_profile_flag(profile: PoolProfile) -> str:
    """PoolProfile -> `--pool-profile`'s value (compact JSON, keys in a fixed order: a stable pod template)."""
    return json.dumps(profile.as_json(), separators=(",", ":"))
