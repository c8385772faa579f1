"""C++ CPU kernels (ATen + OpenMP), built with torch.utils.cpp_extension at first use and cached on disk.

Importing this package builds nothing: `cpu_kernels_available()` (never raises) or the first kernel
call does. See `_extension` for the build (flags, cache directory), `paged_attention`, `packed_linear`,
`quant_linear` (int8 / int4 weights) and `lora_delta` (batched LoRA) for the ops.
"""

from __future__ import annotations

from hpi_kernels.cpu._extension import CpuKernelBuildError, cpu_capability, cpu_kernels_available, load_extension
from hpi_kernels.cpu.lora_delta import lora_add, lora_add_ref
from hpi_kernels.cpu.packed_linear import (
    bf16_tile,
    pack_linear_weight,
    packed_linear,
    packed_logits,
    packed_weight_rows,
    prefill_gemm,
)
from hpi_kernels.cpu.paged_attention import (
    cached_paged_attention_cpu,
    paged_attention_cpu,
    paged_attention_ref,
    prefill_attention_tile,
)
from hpi_kernels.cpu.quant_linear import (
    A8_DEFAULT_SHAPE,
    int4_a8_linear,
    int4_a8_max_rows,
    int4_a8_tile,
    int4_linear,
    int8_a8_linear,
    int8_a8_logits,
    int8_a8_max_rows,
    int8_a8_tile,
    int8_linear,
    int8_logits,
    int8_weight_rows,
    pack_int4_weight,
    pack_int8_weight,
)

__all__ = [
    "A8_DEFAULT_SHAPE",
    "CpuKernelBuildError",
    "bf16_tile",
    "cached_paged_attention_cpu",
    "cpu_capability",
    "cpu_kernels_available",
    "int4_a8_linear",
    "int4_a8_max_rows",
    "int4_a8_tile",
    "int4_linear",
    "int8_a8_linear",
    "int8_a8_logits",
    "int8_a8_max_rows",
    "int8_a8_tile",
    "int8_linear",
    "int8_logits",
    "int8_weight_rows",
    "load_extension",
    "lora_add",
    "lora_add_ref",
    "pack_int4_weight",
    "pack_int8_weight",
    "pack_linear_weight",
    "packed_linear",
    "packed_logits",
    "packed_weight_rows",
    "paged_attention_cpu",
    "paged_attention_ref",
    "prefill_attention_tile",
    "prefill_gemm",
]
