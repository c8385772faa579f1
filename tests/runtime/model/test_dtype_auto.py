"""`dtype="auto"` on CPU follows the ISA: bf16 only where AMX makes it fast, fp32 elsewhere, including CPUs
with AVX512-BF16 but no AMX (where bf16 GEMMs run at half fp32's speed).

The CPU flags are substituted (monkeypatch of the /proc/cpuinfo reader): no one machine has all three ISAs.
The real reader is checked against this machine's /proc/cpuinfo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_runtime import llm
from hpi_runtime.llm import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma"}, torch.float32),
        ({"avx2", "avx512f", "avx512_bf16"}, torch.float32),
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, torch.bfloat16),
        (set(), torch.float32),
    ],
    ids=["avx2", "avx512-bf16-without-amx", "amx", "unknown"],
)
def test_auto_picks_bf16_only_with_amx(monkeypatch, flags: set[str], expected: torch.dtype) -> None:
    monkeypatch.setattr(llm, "_cpu_flags", lambda: flags)
    assert resolve_dtype("auto", CPU, "bfloat16") == expected
    assert resolve_dtype("float32", CPU, "bfloat16") == torch.float32
    assert resolve_dtype("bfloat16", CPU, "float32") == torch.bfloat16


def test_cpu_flags_are_read_from_this_machine() -> None:
    flags = llm._cpu_flags()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        assert flags == set(cpuinfo.read_text().split())
        assert resolve_dtype("auto", CPU, "bfloat16") == (torch.bfloat16 if "amx_bf16" in flags else torch.float32)


def test_unknown_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("float8", CPU, "bfloat16")
