"""Weight-only quantized matmuls: y[M, N] = x[M, K] @ dequant(W)[N, K].T with int8 or packed int4 weights.

Two paths, chosen by the number of rows:
- **Few rows (decode)**: the weight stays quantized in memory, which is the point: the step is bound by reading W.
  Tiles are converted to x's dtype in registers and fed to tl.dot with fp32 accumulation. INT8 applies its
  per-channel scale to the fp32 sums at the end; INT4 dequantizes each weight, (q - 8) * scale + zero, in
  registers with its group's scale and zero (any K tile, spanning several groups), rounded to x's dtype as a
  dequantized copy would be. A decode matmul has few tiles along N, too few to keep 132 SMs reading, so K is
  split over `split_k` programs that write fp32 partial sums, added afterwards (a fixed order: deterministic).
- **Many rows (prefill)**: compute-bound, where a hand-rolled tile loses to cuBLAS: the weight is dequantized into
  a scratch copy in x's dtype by one pass of a Triton kernel, then multiplied by torch.matmul (what vLLM's AWQ
  path does above 256 tokens). The copy lives for one call.
`default_config` picks the tiles per row bucket and the K split; `config` overrides them (the benchmark,
`bench/bench_quant_matmul_gpu.py`, times the unsplit kernels so). Measured on an H200 in GPU time (CUDA graphs):
bench/results/gpu/2026-12-04-h200/README.md.
Formats: see hpi_kernels.quant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_rank, interpreting
from hpi_kernels.quant import check_int4_group_size


@dataclass(frozen=True)
class MatmulConfig:
    """One launch's tiles: rows x columns x K per program, programs per K (split_k), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Rows from which the weight is dequantized and multiplied by cuBLAS. On an H200 (Llama-3.1-8B's linears) the kernels
# were 10-25% faster at 128 rows and the dequantized copy 1.7-2.9x faster at 512; both times grow linearly between,
# and cross near 200.
DEQUANT_MIN_ROWS = 192
# SMs to keep busy when choosing split_k; the H200 has 132.
_TARGET_PROGRAMS = 264


def default_config(m: int, n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The tiles for an [m, k] x [k, n] product in `dtype` (int8 and int4 alike), rows below DEQUANT_MIN_ROWS."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    # fp32 tiles are twice the bytes: a 128-wide K tile would overflow shared memory on pre-Hopper GPUs.
    block_n, block_k = 64, (64 if dtype == torch.float32 else 128)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    # Split K until enough programs read the weight at once, keeping at least 4 K tiles per program.
    split_k = 1
    while tiles * split_k < _TARGET_PROGRAMS and k // (block_k * split_k * 2) >= 4:
        split_k *= 2
    return MatmulConfig(block_m, block_n, block_k, split_k, num_warps=4, num_stages=4)


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr, SPLIT_K):
    """This program's [start, end) of K: whole BLOCK_K tiles, split evenly over SPLIT_K programs."""
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    start = tl.program_id(2) * per_split
    return start, tl.minimum(start + per_split, K)


@triton.jit
def _store(out_ptr, acc, rm, rn, m_mask, n_mask, M, N, stride_out_m, stride_out_n, PARTIAL: tl.constexpr):
    """One program's [BLOCK_M, BLOCK_N] result: into out, or (split K) into its slice of the fp32 partials."""
    mask = m_mask[:, None] & n_mask[None, :]
    if not PARTIAL:
        ptrs = out_ptr + rm[:, None] * stride_out_m + rn[None, :] * stride_out_n
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partials: [SPLIT_K, M, N] fp32, contiguous
        ptrs = out_ptr + tl.program_id(2).to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _int8_matmul_kernel(
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K] int8
    scales_ptr,  # [N]
    out_ptr,  # [M, N], or [SPLIT_K, M, N] fp32 partials
    M, N, K,
    stride_x_m, stride_x_k,
    stride_w_n, stride_w_k,
    stride_out_m, stride_out_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K,  # programs along K (a runtime value: one compiled kernel serves every split)
    PARTIAL: tl.constexpr,  # SPLIT_K > 1: out is the [SPLIT_K, M, N] fp32 partials
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(
            x_ptr + rm[:, None] * stride_x_m + k[None, :] * stride_x_k,
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )
        w = tl.load(
            weight_ptr + rn[None, :] * stride_w_n + k[:, None] * stride_w_k,
            mask=k_mask[:, None] & n_mask[None, :], other=0,
        )  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong
            x = x.to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")  # int8 is exact in fp16 and bf16
    scales = tl.load(scales_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    _store(out_ptr, acc * scales[None, :], rm, rn, m_mask, n_mask, M, N, stride_out_m, stride_out_n, PARTIAL)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # [M, K]
    packed_ptr,  # [N, K // 2] uint8, byte j = (q[2j] << 4) | q[2j + 1]
    scales_ptr,  # [N, K // GROUP_SIZE]
    zeros_ptr,  # [N, K // GROUP_SIZE]
    out_ptr,  # [M, N], or [SPLIT_K, M, N] fp32 partials
    M, N, K,
    stride_x_m, stride_x_k,
    stride_p_n, stride_p_k,
    stride_s_n, stride_s_g,
    stride_z_n, stride_z_g,
    stride_out_m, stride_out_n,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K,  # programs along K (a runtime value: one compiled kernel serves every split)
    PARTIAL: tl.constexpr,  # SPLIT_K > 1: out is the [SPLIT_K, M, N] fp32 partials
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rm[:, None] * stride_x_m
    for k0 in range(k_start, k_end, BLOCK_K):
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed column
        kp_mask = 2 * kp < k_end
        # Even k sit in the high nibbles, odd k in the low ones: split x the same way instead of
        # interleaving the unpacked weights.
        x_mask = m_mask[:, None] & kp_mask[None, :]
        x_even = tl.load(x_rows + (2 * kp)[None, :] * stride_x_k, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + (2 * kp + 1)[None, :] * stride_x_k, mask=x_mask, other=0.0)
        w_mask = kp_mask[:, None] & n_mask[None, :]
        packed = tl.load(packed_ptr + rn[None, :] * stride_p_n + kp[:, None] * stride_p_k, mask=w_mask, other=0)
        packed = packed.to(tl.int32)  # [BLOCK_K // 2, BLOCK_N]
        group = (2 * kp) // GROUP_SIZE  # both nibbles of a byte share a group (GROUP_SIZE is even)
        scales = tl.load(scales_ptr + rn[None, :] * stride_s_n + group[:, None] * stride_s_g, mask=w_mask, other=0.0)
        zeros = tl.load(zeros_ptr + rn[None, :] * stride_z_n + group[:, None] * stride_z_g, mask=w_mask, other=0.0)
        scales = scales.to(tl.float32)
        zeros = zeros.to(tl.float32)
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        w_even = (((packed >> 4) - 8).to(tl.float32) * scales + zeros).to(x_even.dtype)
        w_odd = (((packed & 0xF) - 8).to(tl.float32) * scales + zeros).to(x_even.dtype)
        acc = tl.dot(x_even, w_even, acc=acc, input_precision="ieee")
        acc = tl.dot(x_odd, w_odd, acc=acc, input_precision="ieee")
    _store(out_ptr, acc, rm, rn, m_mask, n_mask, M, N, stride_out_m, stride_out_n, PARTIAL)


@triton.jit
def _dequant_int8_kernel(weight_ptr, scales_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = weight * scales[:, None], in out's dtype; weight and out contiguous."""
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask = (rn < N)[:, None] & (k < K)[None, :]
    offsets = rn[:, None] * K + k[None, :]
    q = tl.load(weight_ptr + offsets, mask=mask, other=0).to(tl.float32)
    scales = tl.load(scales_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (q * scales[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_int4_kernel(packed_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, GROUP_SIZE: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    """out[N, K] = (q - 8) * scale + zero per group, in out's dtype; packed, scales, zeros and out contiguous.
    One program writes BLOCK consecutive elements of the flattened out (coalesced stores); the two k of a packed
    byte, and the k of a group, read the same address (served from cache)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N * K
    n = idx // K
    k = idx % K
    byte = tl.load(packed_ptr + n * (K // 2) + k // 2, mask=mask, other=0).to(tl.int32)
    q = tl.where(k % 2 == 0, byte >> 4, byte & 0xF)
    group = n * (K // GROUP_SIZE) + k // GROUP_SIZE
    scale = tl.load(scales_ptr + group, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + group, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, ((q - 8).to(tl.float32) * scale + zero).to(out_ptr.dtype.element_ty), mask=mask)


_DEQUANT_TILE = (32, 256)  # (BLOCK_N, BLOCK_K) of the int8 dequantization pass
_DEQUANT_INT4_BLOCK = 2048  # elements per program of the int4 one


def _check_x(x: torch.Tensor, k: int) -> None:
    check_rank("x", x, 2, "[M, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dim("x", x, 1, k, "the weight's K")


def _launch(kernel, x: torch.Tensor, n: int, config: MatmulConfig, *args, **constexprs) -> torch.Tensor:
    """Run a matmul kernel over the grid `config` implies; with split K, sum its fp32 partials afterwards."""
    m = x.shape[0]
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    if config.split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    kernel[grid](
        x, *args, out, m, n, x.shape[1], *x.stride(), *_args_strides(args), out.stride(-2), out.stride(-1),
        **constexprs, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, PARTIAL=config.split_k > 1, UPCAST=interpreting() or x.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out if config.split_k == 1 else out.sum(dim=0).to(x.dtype)


def _args_strides(args: tuple[torch.Tensor, ...]) -> list[int]:
    """The strides a kernel takes after x's: every 2-D operand's (N-major weights, group-wise scales and zeros)."""
    return [stride for t in args if t.dim() == 2 for stride in t.stride()]


def dequantized_int8(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight * scales[:, None] as a new [N, K] tensor of `dtype`, by one Triton pass (the prefill path)."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    block_n, block_k = _DEQUANT_TILE
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_int8_kernel[grid](weight.contiguous(), scales.contiguous(), out, n, k, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def dequantized_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """dequantize_int4 as a new [N, K] tensor of `dtype`, by one Triton pass (the prefill path)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    grid = (triton.cdiv(n * k, _DEQUANT_INT4_BLOCK),)
    _dequant_int4_kernel[grid](packed.contiguous(), scales.contiguous(), zeros.contiguous(), out, n, k,
                               GROUP_SIZE=group_size, BLOCK=_DEQUANT_INT4_BLOCK)  # fmt: skip
    return out


def int8_weight_only_matmul(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N] float, per output channel
    config: MatmulConfig | None = None,
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ (weight * scales[:, None]).T; below DEQUANT_MIN_ROWS rows (or with a `config`) without materialising
    the dequantized weight."""
    check_rank("weight", weight, 2, "[N, K]")
    check_dtype("weight", weight, (torch.int8,))
    n, k = weight.shape
    _check_x(x, k)
    check_rank("scales", scales, 1, "[N]")
    check_dtype("scales", scales, FLOAT_DTYPES)
    check_dim("scales", scales, 0, n, "N")
    check_device(x=x, weight=weight, scales=scales)
    m = x.shape[0]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    scales = scales.contiguous()
    if config is None and m >= DEQUANT_MIN_ROWS:
        return x @ dequantized_int8(weight, scales, x.dtype).T
    config = config or default_config(m, n, k, x.dtype)
    # The scales are 1-D: _args_strides skips them, and the kernel takes the weight's two strides.
    return _launch(_int8_matmul_kernel, x, n, config, weight, scales)


def int4_weight_only_matmul(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    packed: torch.Tensor,  # [N, K // 2] uint8, see hpi_kernels.quant
    scales: torch.Tensor,  # [N, K // group_size] float
    zeros: torch.Tensor,  # [N, K // group_size] float, w = (q - 8) * scale + zero
    group_size: int,
    config: MatmulConfig | None = None,
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ dequantize_int4(packed, scales, zeros, group_size).T, the weight rounded to x's dtype; below
    DEQUANT_MIN_ROWS rows (or with a `config`) without materialising it."""
    check_rank("packed", packed, 2, "[N, K // 2]")
    check_dtype("packed", packed, (torch.uint8,))
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_x(x, k)
    check_int4_group_size(k, group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        check_rank(name, t, 2, "[N, K // group_size]")
        check_dtype(name, t, FLOAT_DTYPES)
        if tuple(t.shape) != (n, k // group_size):
            raise ValueError(f"{name} must be [N, K // group_size] = {(n, k // group_size)}, got {tuple(t.shape)}")
    check_device(x=x, packed=packed, scales=scales, zeros=zeros)
    m = x.shape[0]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if config is None and m >= DEQUANT_MIN_ROWS:
        return x @ dequantized_int4(packed, scales, zeros, group_size, x.dtype).T
    config = config or default_config(m, n, k, x.dtype)
    return _launch(_int4_matmul_kernel, x, n, config, packed, scales, zeros, GROUP_SIZE=group_size)
