"""Weight-only quantized matmuls: y[M, N] = x[M, K] @ dequant(W)[N, K].T with int8 or packed int4 weights.

Weights stay quantized in memory (the point for decode, where M is small and the matmul is bound by
reading W); tiles are converted to x's dtype in registers and fed to tl.dot with fp32 accumulation.
INT8 applies its per-channel scale once at the end. INT4 keeps each K tile inside one quantization group,
so the group's scale and zero are applied to the tile's partial product rather than to every weight:
sum_k x_k ((q_k - 8) s + z) = s * sum_k x_k (q_k - 8) + z * sum_k x_k.
Formats: see hpi_kernels.quant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_rank, interpreting
from hpi_kernels.quant import check_int4_group_size


@triton.jit
def _int8_matmul_kernel(
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K] int8
    scales_ptr,  # [N]
    out_ptr,  # [M, N]
    M, N, K,
    stride_x_m, stride_x_k,
    stride_w_n, stride_w_k,
    stride_out_m, stride_out_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
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
    out = acc * scales[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_out_m + rn[None, :] * stride_out_n,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # [M, K]
    packed_ptr,  # [N, K // 2] uint8, byte j = (q[2j] << 4) | q[2j + 1]
    scales_ptr,  # [N, K // GROUP_SIZE]
    zeros_ptr,  # [N, K // GROUP_SIZE]
    out_ptr,  # [M, N]
    M, N, K,
    stride_x_m, stride_x_k,
    stride_p_n, stride_p_k,
    stride_s_n, stride_s_g,
    stride_z_n, stride_z_g,
    stride_out_m, stride_out_n,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE, so a K tile never straddles two groups
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed column; K % GROUP_SIZE == 0, so no K mask
        x_rows = x_ptr + rm[:, None] * stride_x_m
        x_mask = m_mask[:, None]
        # Even k sit in the high nibbles, odd k in the low ones: split x the same way instead of
        # interleaving the unpacked weights.
        x_even = tl.load(x_rows + (2 * kp)[None, :] * stride_x_k, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + (2 * kp + 1)[None, :] * stride_x_k, mask=x_mask, other=0.0)
        packed = tl.load(
            packed_ptr + rn[None, :] * stride_p_n + kp[:, None] * stride_p_k, mask=n_mask[None, :], other=0
        ).to(tl.int32)  # [BLOCK_K // 2, BLOCK_N]
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        q_even = ((packed >> 4) - 8).to(x_even.dtype)  # [-8, 7]: exact in fp16 and bf16
        q_odd = ((packed & 0xF) - 8).to(x_even.dtype)
        partial = tl.dot(x_even, q_even, input_precision="ieee")
        partial = tl.dot(x_odd, q_odd, acc=partial, input_precision="ieee")
        group = k0 // GROUP_SIZE
        scales = tl.load(scales_ptr + rn * stride_s_n + group * stride_s_g, mask=n_mask, other=0.0)
        zeros = tl.load(zeros_ptr + rn * stride_z_n + group * stride_z_g, mask=n_mask, other=0.0)
        x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)  # [BLOCK_M]
        acc += partial * scales.to(tl.float32)[None, :] + x_sum[:, None] * zeros.to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_out_m + rn[None, :] * stride_out_n,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _tiles(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): thin tiles for decode (M small), square ones for prefill."""
    if m <= 16:
        return 16, (32 if n <= 8192 else 64), 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


def _check_x(x: torch.Tensor, k: int) -> None:
    check_rank("x", x, 2, "[M, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dim("x", x, 1, k, "the weight's K")


def int8_weight_only_matmul(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N] float, per output channel
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ (weight * scales[:, None]).T without materialising the dequantized weight."""
    check_rank("weight", weight, 2, "[N, K]")
    check_dtype("weight", weight, (torch.int8,))
    n, k = weight.shape
    _check_x(x, k)
    check_rank("scales", scales, 1, "[N]")
    check_dtype("scales", scales, FLOAT_DTYPES)
    check_dim("scales", scales, 0, n, "N")
    device = check_device(x=x, weight=weight, scales=scales)
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, num_warps = _tiles(m, n)
    block_k = 128 if m <= 16 else 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int8_matmul_kernel[grid](
        x, weight, scales.contiguous(), out, m, n, k,
        *x.stride(), *weight.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=interpreting() or x.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out


def int4_weight_only_matmul(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    packed: torch.Tensor,  # [N, K // 2] uint8, see hpi_kernels.quant
    scales: torch.Tensor,  # [N, K // group_size] float
    zeros: torch.Tensor,  # [N, K // group_size] float, w = (q - 8) * scale + zero
    group_size: int,
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ dequantize_int4(packed, scales, zeros, group_size).T without materialising the weight."""
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
    device = check_device(x=x, packed=packed, scales=scales, zeros=zeros)
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, num_warps = _tiles(m, n)
    # fp32 tiles are twice the bytes: a 128-wide K tile would overflow shared memory on pre-Hopper GPUs.
    block_k = min(group_size, 64 if x.dtype == torch.float32 else 128)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int4_matmul_kernel[grid](
        x, packed, scales, zeros, out, m, n, k,
        *x.stride(), *packed.stride(), *scales.stride(), *zeros.stride(), *out.stride(),
        GROUP_SIZE=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=interpreting() or x.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out
