"""C++ CPU kernels (ATen + OpenMP), built with torch.utils.cpp_extension at first use and cached on disk.

Importing this package builds nothing: `cpu_attention_available()` (never raises) or the first kernel
call does. See `_extension` for the build (flags, cache directory) and `paged_attention` for the op.
"""

from __future__ import annotations

from hpi_kernels.cpu._extension import CpuKernelBuildError, cpu_attention_available, cpu_capability, load_extension
from hpi_kernels.cpu.paged_attention import cached_paged_attention_cpu, paged_attention_cpu, paged_attention_ref

__all__ = [
    "CpuKernelBuildError",
    "cached_paged_attention_cpu",
    "cpu_attention_available",
    "cpu_capability",
    "load_extension",
    "paged_attention_cpu",
    "paged_attention_ref",
]
