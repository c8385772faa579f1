"""fp32 linear layers over prepacked weights on CPU (packed_linear.cpp), for the few-row GEMMs of decode steps.

`pack_linear_weight` turns a [out_features, in_features] weight into column panels ([panels, in_features,
PANEL], PANEL = 32 columns with AVX512, 16 with AVX2, zero-padded past out_features); `packed_linear` is
`F.linear` over it. Up to a few hundred rows the kernel streams each panel once while it computes (1.3-1.8x
MKL's sgemm at 8-64 rows here, as fast at one row); prefill-sized inputs go to MKL over the weight unpacked
into a per-thread scratch buffer. A row's result does not depend on the other rows below that size.
"""

from __future__ import annotations

import torch

from hpi_kernels.cpu._extension import load_extension


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out_features, in_features] float32 CPU (any strides) -> [panels, in_features, PANEL], contiguous.

    Raises ValueError for another dtype, device or rank; CpuKernelBuildError without a toolchain."""
    load_extension()
    return torch.ops.hpi_kernels.pack_linear_weight(weight)


def packed_linear(
    x: torch.Tensor,  # [..., in_features] float32
    packed: torch.Tensor,  # from pack_linear_weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] float32
) -> torch.Tensor:  # [..., out_features]
    """x @ weight.T + bias over the packed weight (torch.ops.hpi_kernels.packed_linear, which models call
    directly). A packed weight of another CPU capability's panel width, or mismatched shapes, raise ValueError."""
    load_extension()
    return torch.ops.hpi_kernels.packed_linear(x, packed, out_features, bias)


def packed_weight_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weight[rows] read from the packed weight ([*rows.shape, in_features]; plain torch indexing, which
    torch.compile traces): an embedding that shares its matrix with a packed LM head looks tokens up here."""
    panel = packed.shape[2]
    return packed[rows // panel, :, rows % panel]
