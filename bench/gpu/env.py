"""The environment part, run first: what this machine is (GPU, driver, versions) and whether everything the kit
runs imports and launches here. It fails in seconds when an import or the first kernel launch breaks, so the
script stops before spending the lease on parts that cannot run.

The GPU machine brings its own torch and triton (2.11 / 3.6 when last seen), not the 2.13.0 / 3.7.1 this project
pins; the kit runs on them unchanged and reports them, so a failure below can be read against the version gap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from bench.gpu.part import PartContext

PINNED = {"torch": "2.13.0", "triton": "3.7.1"}
# Imported here so that a broken import fails this part, not a later one: every module the later parts start from.
MODULES = (
    "hpi_contracts", "hpi_kernels", "hpi_kernels.paged_attention", "hpi_kernels.prefill_attention",
    "hpi_kernels.quant_matmul", "hpi_kernels.fused_moe", "hpi_kernels.lora", "hpi_runtime.cli",
    "hpi_runtime.engine_factory", "hpi_runtime.server.app", "hpi_runtime.worker.executor",
    "hpi_runtime.worker.host_kv_cache", "hpi_runtime.structured.compiler", "bench.loadgen", "bench.systems",
)  # fmt: skip
DISTRIBUTIONS = ("torch", "triton", "transformers", "tokenizers", "safetensors", "aiohttp", "prometheus-client",
                 "msgspec", "xgrammar", "numpy", "pytest", "pytest-timeout", "pytest-asyncio")  # fmt: skip


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def _driver() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "no nvidia-smi"


def _isa() -> str:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or platform.machine()


def _first_launch(device: torch.device) -> dict:
    """One bf16 matmul and one Triton kernel (the KV-cache write) on the device: the first places a broken driver,
    CUDA build or Triton install shows itself."""
    from hpi_kernels import write_kv_cache

    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    k = torch.randn(4, 2, 64, device=device, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 64, device=device, dtype=torch.bfloat16)
    write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 1, -1, 17], device=device))
    torch.cuda.synchronize(device)
    if not torch.equal(cache[0, :2], k[:2]) or not torch.equal(cache[1, 1], k[3]):
        raise RuntimeError("the Triton KV-cache write on this GPU wrote the wrong slots")
    return {"matmul_bf16": "ok", "triton_write_kv_cache": "ok"}


def run(ctx: PartContext) -> dict:
    for module in MODULES:
        importlib.import_module(module)  # an ImportError fails the part, and gpu_check.sh stops
    versions = {name: _version(name) for name in DISTRIBUTIONS}
    results: dict = {
        "python": platform.python_version(),
        "versions": versions,
        "pinned": PINNED,
        "differs_from_pins": sorted(k for k, v in PINNED.items() if versions[k].split("+")[0] != v),
        "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "cpu_isa": _isa(),
        "dry_run": ctx.dry_run,
    }
    if ctx.device.type != "cuda":
        return {**results, "skipped": {"gpu": "no CUDA device (a dry run): device, driver and first launch"}}
    properties = torch.cuda.get_device_properties(ctx.device)
    results.update(
        device=properties.name, capability=f"{properties.major}.{properties.minor}",
        memory_gib=round(properties.total_memory / 2**30, 1), multiprocessors=properties.multi_processor_count,
        driver=_driver(), first_launch=_first_launch(ctx.device),
    )  # fmt: skip
    gpu = f"{results['device']} (sm_{properties.major}{properties.minor}, {results['memory_gib']} GiB)"
    results["headline"] = [f"{gpu}, driver {results['driver']}; torch {versions['torch']}, triton {versions['triton']}"
                           f", Python {results['python']}"]  # fmt: skip
    return results
