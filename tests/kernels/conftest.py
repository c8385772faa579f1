"""Fixtures for kernel tests: paged K/V caches with scattered block tables, built on CPU for the interpreter;
re-running a C++ kernel's tests under a lower CPU capability."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Kernel tests run on the GPU where there is one, else in Triton's interpreter on CPU (see tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def cpu_kernel_threads(request: pytest.FixtureRequest):
    """The C++ CPU kernels split their work over OpenMP threads (panels, rows, heads, a scratch buffer per thread):
    their tests run with at least two threads, even in a pytest-xdist worker given one core (tests/conftest.py)."""
    if not request.path.name.startswith("test_cpu_"):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    yield
    torch.set_num_threads(previous)


@dataclass(frozen=True)
class PagedCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32


def make_paged_cache(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    non_contiguous: bool = False,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> PagedCache:
    """Random K/V in a cache with spare blocks; each request's blocks are scattered, in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed)  # K/V drawn where they live: GPU caches are big
    blocks_per_req = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_req) + 3
    max_blocks = max(blocks_per_req) + 1  # a padded column the kernels must never read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if non_contiguous:
        # One [num_blocks, 2, H, block_size, D] allocation viewed as K and V: every stride differs from
        # the contiguous layout's.
        kv = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim, generator=values, device=device)
        kv = kv.to(dtype)
        k_cache, v_cache = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    else:
        k_cache = torch.randn(shape, generator=values, device=device).to(dtype)
        v_cache = torch.randn(shape, generator=values, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(blocks_per_req):
        block_tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    context_lens_t = torch.tensor(context_lens, dtype=torch.int32)
    return PagedCache(k_cache, v_cache, block_tables.to(device), context_lens_t.to(device))


@pytest.fixture
def paged_cache():
    return make_paged_cache


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Attention outputs (magnitude ~1) against the fp32 reference rounded to dtype."""
    return {
        torch.float32: {"atol": 1e-4, "rtol": 1e-4},
        torch.float16: {"atol": 3e-3, "rtol": 1e-2},
        torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    }[dtype]


@pytest.fixture
def tol():
    return tolerance


def run_at_lower_capability(test_files: list[str], capability: str, selection: str,
                            extra_env: dict[str, str] | None = None) -> None:  # fmt: skip
    """Re-run the tests of `test_files` that `selection` (-k) picks in one child whose torch dispatches to the
    lower instruction set `capability`, so that the C++ CPU kernels' AVX2 (CI) and generic builds are checked
    on every machine that can run them; skips where `capability` is not below this machine's. The child sees
    HPI_EXPECT_CPU_CAPABILITY, for a test that checks which build it loaded, and `extra_env`."""
    from hpi_kernels.cpu._extension import cpu_capability, lower_capabilities

    if capability not in lower_capabilities(cpu_capability()):
        pytest.skip(f"{capability} is not below this machine's {cpu_capability()}")
    run_in_child(test_files, selection, {"ATEN_CPU_CAPABILITY": capability.lower(),
                                         "HPI_EXPECT_CPU_CAPABILITY": capability, **(extra_env or {})})  # fmt: skip


def run_in_child(test_files: list[str], selection: str, extra_env: dict[str, str]) -> None:
    """Re-run the tests of `test_files` that `selection` (-k) picks in one child process with `extra_env` set (a
    kernel path that this CPU would not take by itself, forced by its environment variable)."""
    env = {**os.environ, **extra_env}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *test_files, "-q", "-p", "no:cacheprovider", "-k", selection],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.fixture(params=["bf16", "fp32"])
def forced_prefill_gemm(request):
    """Each prefill GEMM with bf16 x forced (the machine's own choice is measured at start), so both paths run on
    any machine; the choice is restored after the test."""
    from hpi_kernels.cpu import prefill_gemm

    previous = prefill_gemm()
    assert prefill_gemm(request.param) == request.param
    yield request.param
    prefill_gemm(previous)


def _forced_bf16_tile(tile: str):
    """The tile forced for one test (skipped where this CPU lacks it), the machine's choice restored after it."""
    from hpi_kernels.cpu import bf16_tile

    previous = bf16_tile()
    try:
        assert bf16_tile(tile) == tile
    except ValueError as e:
        pytest.skip(f"{tile}: {e}")
    yield tile
    bf16_tile(previous)


@pytest.fixture(params=["widen", "dpbf16"])
def forced_bf16_tile(request):
    """Each vector bf16 tile forced (the machine's own choice is measured at start), so both run wherever the CPU
    has them: dpbf16 needs AVX512-BF16 and the AVX512 build. The int8/int4 tiles and the LoRA kernel follow it."""
    yield from _forced_bf16_tile(request.param)


@pytest.fixture(params=["widen", "dpbf16", "amx"])
def forced_packed_bf16_tile(request):
    """forced_bf16_tile plus the packed bf16 linear's AMX tile, which needs a CPU with AMX-BF16 (no emulation
    exists: elsewhere that case is skipped, and the two vector tiles still run)."""
    yield from _forced_bf16_tile(request.param)
