"""What this CPU's instruction set offers the runtime (read from /proc/cpuinfo): the choices that depend on it
(dtype "auto", which weights are packed for the C++ kernels) ask here."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo (empty where there is none: not Linux), read once: packing asks per weight."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def has_fast_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 dot products or AMX tiles), not emulated."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_amx() -> bool:
    """AMX bf16 tiles, which torch's bf16 GEMMs (oneDNN) use: 3-5x fp32 (docs/engine.md, "dtype on CPU")."""
    return "amx_bf16" in cpu_flags()
