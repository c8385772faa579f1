"""hetero-paged-infer kernels: Triton paged attention, weight-only quantized matmul, fused MoE and
batched LoRA, with references.

Launchers import Triton lazily, on first use: importing hpi_kernels (or hpi_kernels.quant /
hpi_kernels.reference, which need only torch) works on machines without a GPU or without Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAUNCHERS = {
    "write_kv_cache": "hpi_kernels.kv_cache",
    "paged_decode_attention": "hpi_kernels.paged_attention",
    "paged_prefill_attention": "hpi_kernels.prefill_attention",
    "fused_experts": "hpi_kernels.fused_moe",
    "lora_bgmv": "hpi_kernels.lora",
    "lora_delta": "hpi_kernels.lora",
    "int8_weight_only_matmul": "hpi_kernels.quant_matmul",
    "int4_weight_only_matmul": "hpi_kernels.quant_matmul",
    "quantize_int8": "hpi_kernels.quant",
    "dequantize_int8": "hpi_kernels.quant",
    "quantize_int4": "hpi_kernels.quant",
    "dequantize_int4": "hpi_kernels.quant",
}

__all__ = sorted(_LAUNCHERS)


def __getattr__(name: str) -> Any:
    module = _LAUNCHERS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpi_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAUNCHERS])
