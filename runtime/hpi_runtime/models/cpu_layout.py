"""How the float weights of a loaded CPU model are laid out for its GEMMs: packed into column panels for
hpi_kernels' C++ packed_linear where the CPU kernels build; else fp32 column-major for MKL's sgemm.

Both run once, after loading and quantization (executor.LocalExecutor). bf16 weights are packed too; on CPUs
with AMX the packed GEMMs run AMX tiles over the panels as they are (hpi_kernels' "amx" tile, 1.4-2.2x torch's own
bf16 GEMM at 16-128 rows, which reorders the weight for its tiles on every call), unless the start-up measurement
or HPI_CPU_BF16_TILE chose a vector tile there, in which case bf16 weights stay as loaded for oneDNN. fp16
weights stay as loaded; quantized layers keep their own packed formats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from hpi_kernels.cpu import (
    bf16_tile,
    cpu_kernels_available,
    pack_linear_weight,
    prefill_attention_tile,
    prefill_gemm,
)
from hpi_runtime import cpu_features
from hpi_runtime.models.layers import LMHead, VocabEmbedding
from hpi_runtime.models.linear import LinearBase

logger = logging.getLogger(__name__)


def choose_bf16_gemms(dtype: torch.dtype) -> dict[str, str] | None:
    """Settle, at start-up, how this CPU runs the GEMMs of bf16 models and log it: the packed tile of decode-sized
    GEMMs and LM heads (hpi_kernels' bf16_tile: widen to fp32, vdpbf16ps or AMX tiles; HPI_CPU_BF16_TILE
    overrides) and the prefill-sized GEMMs (prefill_gemm: torch's bf16 GEMM or MKL's fp32 sgemm;
    HPI_CPU_PREFILL_GEMM overrides), each whichever a short measurement finds faster. None where they do not apply
    (another dtype, no C++ kernels)."""
    if dtype != torch.bfloat16 or not cpu_kernels_available():
        return None
    chosen = {"tile": bf16_tile(), "prefill": prefill_gemm(), "attention": prefill_attention_tile()}
    logger.info("bf16 GEMMs on this CPU (measured at start): the %s tile up to prefill size (HPI_CPU_BF16_TILE="
                "widen|dpbf16|amx overrides), prefill in %s (HPI_CPU_PREFILL_GEMM=bf16|fp32 overrides); prefill "
                "attention on %s tiles (HPI_CPU_ATTENTION_TILE=amx|vector overrides)", chosen["tile"],
                chosen["prefill"], chosen["attention"])  # fmt: skip
    return chosen


def _is_float32_cpu(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _packs(weight: torch.Tensor) -> bool:
    """Whether pack_cpu_weights packs this weight (given the C++ kernels): fp32, or bf16 without AMX or where the
    packed GEMMs run AMX tiles (bf16_tile "amx")."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16 and cpu_features.has_amx():
        return cpu_kernels_available() and bf16_tile() == "amx"
    return weight.dtype in (torch.float32, torch.bfloat16)


def _panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """The matrix pack_cpu_weights packs for `weight`: an fp32 weight whose every value is a bf16 value (the
    checkpoint was bf16, as most are, and the model runs in fp32: dtype "auto" on CPUs without fast bf16) goes
    in as bf16, half the bytes, which the packed op multiplies with fp32 x bit for bit as fp32 panels would
    (hpi_kernels' widen tile: the same products summed in the same order; prefill widens it back for MKL)."""
    if weight.dtype != torch.float32:
        return weight
    as_bf16 = weight.to(torch.bfloat16)
    return as_bf16 if torch.equal(as_bf16.float(), weight) else weight


def _unpacked_linears(model: nn.Module, keep: Callable[[torch.Tensor], bool]) -> list[LinearBase]:
    return [
        module
        for module in model.modules()
        if isinstance(module, LinearBase) and module.packed_out_features is None and keep(module.weight)
    ]


def pack_cpu_weights(model: nn.Module) -> int:
    """Replace the fp32 and bf16 (see _packs) CPU weights of the linear layers and the LM head (with an
    embedding that shares it) by hpi_kernels' packed column panels; returns how many matrices were packed, 0
    where the C++ kernels do not build (use_sgemm_layout is the fallback then).

    The packed weight is no [out, in] matrix any more: loaders and quantization cannot read it, so this runs
    after both. Each panel streams once per step while the kernel computes: a 32-row decode step's linears
    ran 1.5x faster than MKL over column-major weights, and its LM head 1.3x; one row as fast; prefill-sized
    inputs go to MKL (bench/results/hot_path.md, fourth pass). fp32 weights that hold bf16 values are packed as
    bf16 (_panel_weight): same results, half the bytes. bf16 panels are widened to fp32 in registers:
    without AMX, torch's bf16 GEMMs run at half fp32's speed, and these at fp32's over half the bytes
    (fifth pass); with AMX, the panels feed AMX tiles (bench/results/amx.md). A tied embedding then looks tokens
    up in the panels (packed_weight_rows).
    """
    linears = _unpacked_linears(model, _packs)
    heads = [m for m in model.modules() if isinstance(m, LMHead) and not m.packed and _packs(m.weight)]
    if not (linears or heads) or not cpu_kernels_available():
        return 0
    for module in linears:
        out_features = module.weight.shape[0]
        module.weight = nn.Parameter(pack_linear_weight(_panel_weight(module.weight.detach())), requires_grad=False)
        module.packed_out_features = out_features
    embeddings = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    for head in heads:
        tied = [e for e in embeddings if e.weight is head.weight]
        dtype = head.weight.dtype
        head.weight = nn.Parameter(pack_linear_weight(_panel_weight(head.weight.detach())), requires_grad=False)
        head.packed = True
        for embedding in tied:
            embedding.weight, embedding.packed, embedding.rows_dtype = head.weight, True, dtype
    return len(linears) + len(heads)


def use_sgemm_layout(model: nn.Module) -> int:
    """Store the fp32 weights of the model's CPU linear layers column-major; returns how many moved.

    The logical [out, in] parameter stays (loaders, quantization and tensor parallelism see no change);
    only its storage becomes [in, out]-contiguous, so `F.linear` hands MKL's sgemm an untransposed B. At the
    4-128 rows of a decode step that runs the model's linears 1.1-1.3x faster (AVX512 here; the layout is
    MKL's, not the ISA's: bench/results/hot_path.md). pack_cpu_weights, where the C++ kernels build, is
    faster still; this is its fallback.
    """
    moved = 0
    for module in _unpacked_linears(model, _is_float32_cpu):
        weight = module.weight
        if weight.stride() != (1, weight.shape[0]):
            weight.data = weight.data.t().contiguous().t()
            moved += 1
    return moved
