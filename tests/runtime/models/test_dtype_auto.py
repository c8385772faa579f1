"""`dtype="auto"` on CPU follows the ISA: bf16 where AMX makes torch's GEMMs fast, or where AVX512-BF16 and the
C++ kernels' packed bf16 linears do; fp32 elsewhere (AVX2: bf16 emulated; AVX512-BF16 without the kernels,
where torch's bf16 GEMMs run at half fp32's speed).

The CPU flags are substituted (monkeypatch of the /proc/cpuinfo reader), and so is whether the C++ kernels
build: no one machine has every ISA, or lacks a compiler. The real reader is checked against this machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_kernels.cpu import cpu_kernels_available
from hpi_runtime import cpu_features, engine_factory
from hpi_runtime.engine_factory import resolve_dtype

CPU = torch.device("cpu")
AVX512_BF16 = {"avx2", "avx512f", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    ("flags", "kernels", "expected"),
    [
        ({"avx2", "fma"}, True, torch.float32),
        (AVX512_BF16, True, torch.bfloat16),
        (AVX512_BF16, False, torch.float32),
        (AMX, True, torch.bfloat16),
        (AMX, False, torch.bfloat16),
        (set(), True, torch.float32),
    ],
    ids=["avx2", "avx512-bf16-with-kernels", "avx512-bf16-without-kernels", "amx", "amx-without-kernels", "unknown"],
)
def test_auto_picks_bf16_where_it_is_fast(monkeypatch, flags: set[str], kernels: bool, expected: torch.dtype) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    monkeypatch.setattr(engine_factory, "cpu_kernels_available", lambda: kernels)
    assert resolve_dtype("auto", CPU, "bfloat16") == expected
    assert resolve_dtype("float32", CPU, "bfloat16") == torch.float32
    assert resolve_dtype("bfloat16", CPU, "float32") == torch.bfloat16


def test_cpu_flags_are_read_from_this_machine() -> None:
    flags = cpu_features.cpu_flags()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        assert flags == set(cpuinfo.read_text().split())
        bf16 = "amx_bf16" in flags or ("avx512_bf16" in flags and cpu_kernels_available())
        assert resolve_dtype("auto", CPU, "bfloat16") == (torch.bfloat16 if bf16 else torch.float32)


def test_unknown_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("float8", CPU, "bfloat16")
