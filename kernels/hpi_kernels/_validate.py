"""Shared launcher plumbing: argument validation (clear ValueErrors) and interpreter detection."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One-byte KV caches (`--kv-cache-dtype fp8*`): written saturated at the format's largest finite value, unscaled.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Caches that rows of any float dtype are written into (rounded to nearest even) and read from (widened):
# `--kv-cache-dtype bfloat16` (half an fp32 model's bytes) and the fp8 types.
CONVERTED_KV_DTYPES = (torch.bfloat16, *FP8_KV_DTYPES)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and one a Triton kernel can run on (CUDA, or CPU under the interpreter)."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if first.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {first}")
    return first


def check_rank(name: str, t: torch.Tensor, rank: int, shape_doc: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {shape_doc}, got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {allowed}, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}.shape[{dim}] must equal {what} ({expected}), got {t.shape[dim]}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same shape and float (or fp8) dtype."""
    check_rank("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_rank("v_cache", v_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    check_dtype("k_cache", k_cache, FLOAT_DTYPES + FP8_KV_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")


def check_query_heads(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Returns the GQA group size num_q_heads // num_kv_heads; query is [..., num_q_heads, head_dim]."""
    num_q_heads, head_dim = query.shape[-2], query.shape[-1]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype != k_cache.dtype and k_cache.dtype not in CONVERTED_KV_DTYPES:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype} (nor a bf16 or fp8 cache)")
    return num_q_heads // num_kv_heads


def dot_in_fp32(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a Triton attention kernel widens q and K/V to fp32 for its dots (its UPCAST): under the interpreter,
    which gets bf16 arithmetic wrong; for fp32 queries; and for fp16 queries over a bf16 cache, whose values
    fp16 cannot all hold (bf16 rounds 65504 up to 65536)."""
    return (
        interpreting()
        or query.dtype == torch.float32
        or (query.dtype == torch.float16 and k_cache.dtype == torch.bfloat16)
    )


def check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The caller's output buffer (same shape, dtype and device as query), or a new contiguous one."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query: {tuple(query.shape)} {query.dtype} on {query.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def check_window_and_softcap(sliding_window: int | None, logit_softcap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
