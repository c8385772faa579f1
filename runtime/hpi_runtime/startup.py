"""Start-up, phase by phase: how long each step from process start to ready took, for the log, /metrics
(`hpi:startup_phase_seconds{phase}`, `hpi:startup_seconds`) and whoever tunes a cold start.

Phases, in order (a phase that did not run is absent): `imports` (process start to the server's loader: Python,
torch, our modules), `prepare` (the model's files resolved or downloaded, its config and tokenizer read),
`core_process` (the engine core's process spawned and importing, until it starts loading), `load` (weights read
from safetensors), `quantize`, `layout` (weights packed for the CPU kernels; these two run as each layer is read,
within `load`'s span, and are counted apart from it), `kv_cache` (the paged KV cache and the host tier allocated),
`compile` (the model step compiled and warmed up per shape), `warm_up` (one request through the whole server). The
engine core's phases come from its process (CoreInfo); with tensor parallelism each is the slowest worker's, and
`core_process` also covers spawning the workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

PHASES = ("imports", "prepare", "core_process", "load", "quantize", "layout", "kv_cache", "compile", "warm_up")
ENGINE_PHASES = ("load", "quantize", "layout", "kv_cache", "compile")


class PhaseClock:
    """Times named phases: `with clock("load"): ...`; a phase run twice adds up."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - start


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 0.0)  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return None


def ordered(phases: Mapping[str, float]) -> dict[str, float]:
    """The phases in PHASES order (unknown names after them)."""
    known = {p: phases[p] for p in PHASES if p in phases}
    return known | {p: s for p, s in phases.items() if p not in known}


def describe(phases: Mapping[str, float], total_s: float | None) -> str:
    parts = ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f} s" for phase, seconds in ordered(phases).items())
    return f"started in {total_s:.1f} s: {parts}" if total_s is not None else f"started: {parts}"
