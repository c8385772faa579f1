"""Weight-only quantization formats: pure quantize / dequantize / pack / unpack helpers (torch only).

INT8: symmetric, one scale per output channel: w ~= q * scale, q in [-127, 127]. Weights of a channel are
roughly centred on zero, and int8 has enough levels that a zero point buys nothing but an extra add.

INT4: asymmetric, group-wise along K (group size 32/64/128): w ~= (q - 8) * scale + zero, q in [0, 15],
with a floating zero (zero = group_min + 8 * scale). With only 16 levels, a symmetric grid wastes up to
half of them on a skewed group; min/max quantization spends all 16 on the group's actual range (lower
error, same storage plus one [N, K // group_size] tensor). The "(q - 8) * scale + zero" form is the one
gpt-fast, torchao and torch's own int4 ops use (`aten._weight_int4pack_mm_for_cpu` takes exactly these
scales and zeros, see `to_torch_scales_and_zeros`), so one quantized state dict serves the CPU ops and
these Triton kernels. Packing: two values per byte along K, byte j of a row = (q[2j] << 4) | q[2j + 1]
(torch's uint8 int4 convention).
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [N, K] tensor, got {weight.dtype} {tuple(weight.shape)}")


def check_int4_group_size(k: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size != 0:
        raise ValueError(f"K ({k}) must be a multiple of group_size ({group_size})")


def quantize_int8(
    weight: torch.Tensor,  # [N, K] float
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (q [N, K] int8, scales [N] scale_dtype or weight.dtype)
    _check_weight(weight)
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10).to(scale_dtype or weight.dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(
    q: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, K] fp32
    return q.float() * scales.float()[:, None]


def pack_int4(q: torch.Tensor) -> torch.Tensor:  # q: [N, K] uint8 in [0, 15] -> [N, K // 2] uint8
    if q.dim() != 2 or q.shape[1] % 2 != 0:
        raise ValueError(f"q must be [N, K] with even K, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # packed: [N, K // 2] uint8 -> [N, K] uint8
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(packed.shape[0], -1)


def quantize_int4(
    weight: torch.Tensor,  # [N, K] float
    group_size: int = 128,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (packed [N, K // 2] uint8, scales [N, K // group_size], zeros [N, K // group_size])."""
    _check_weight(weight)
    n, k = weight.shape
    check_int4_group_size(k, group_size)
    w = weight.float().reshape(n, k // group_size, group_size)
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    dtype = scale_dtype or weight.dtype
    # q is computed from the stored (rounded) scale and zero, so rounding them costs no extra error.
    scales = ((w_max - w_min) / 15.0).clamp(min=1e-10).to(dtype)
    zeros = (w_min + 8.0 * scales.float()).to(dtype)
    q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8.0).clamp(0, 15)
    return pack_int4(q.to(torch.uint8).reshape(n, k)), scales, zeros


def dequantize_int4(
    packed: torch.Tensor,  # [N, K // 2] uint8
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor,  # [N, K // group_size]
    group_size: int,
) -> torch.Tensor:  # [N, K] fp32
    q = unpack_int4(packed).float()
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size)
    w = (q - 8.0) * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(n, k)


def to_torch_scales_and_zeros(
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor,  # [N, K // group_size]
) -> torch.Tensor:  # [K // group_size, N, 2], the layout aten._weight_int4pack_mm_for_cpu takes
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
