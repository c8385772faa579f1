"""A GPU pool's performance before anything was measured on it: a roofline estimate from the GPU's published
figures, marked `source: assumed` wherever it is shown (status, the optimizer's explanation, docs).

Decode reads every weight once per step and each sequence's KV cache once per step, at a fraction of the
memory bandwidth; prefill runs at a fraction of the dense bf16/fp16 tensor throughput, 2 FLOPs per parameter
per token. The fractions are the ones well-tuned engines reach on these parts (DECODE_BANDWIDTH_EFFICIENCY,
PREFILL_FLOPS_EFFICIENCY); a measured profile (`hpi profile`, issue "fleet optimizer") or the spec's own
figures (spec.placement.pools[].performance) replace the estimate. CPU pools have no entry: their speed
varies too much with the part (AVX2, AVX512-BF16, AMX) to assume one; they need a measurement or an override.

The figures below are the vendors' datasheet values (memory bandwidth; dense bf16/fp16 matrix throughput,
without sparsity): NVIDIA's, read 2026-12; AMD Instinct's are the figures of AMD's product pages
    https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html    (5.3 TB/s, 1307.4 TFLOPS)
    https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html    (6.0 TB/s, 1307.4 TFLOPS)
    https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html    (3.2 TB/s, 383 TFLOPS per module)
    https://www.amd.com/en/products/accelerators/instinct/mi200/mi210.html     (1.6 TB/s, 181 TFLOPS)
as of 2026-12-01. This machine reaches no vendor site, so they were checked that day against copies: MI300X's and
MI325X's in docs.vultr.com's ROCm inference cookbook ("Specifications from AMD MI325X product page") and a public
MI300X-vs-H200 report; MI250X's in ROCm's MI250 microarchitecture page (1.6 TB/s per die); MI210's were not
re-checked here. An MI250X module is two dies that the device plugin exposes as two `amd.com/gpu` (64 GiB each),
so its row holds half a module's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..profiles import Profile
from ..sizing import ModelShape, active_parameters, kv_bytes_per_token
from .performance import PoolPerformance

DECODE_BANDWIDTH_EFFICIENCY = 0.6
PREFILL_FLOPS_EFFICIENCY = 0.4


@dataclass(frozen=True)
class GpuFigures:
    memory_bandwidth_gbps: float  # GB/s
    dense_tflops_16bit: float  # bf16/fp16 tensor cores, dense


# Matched against the pool's product name (nvidia.com/gpu.product from GPU Feature Discovery, amd.com/gpu.product-name
# from the AMD node labeller: e.g. AMD_Instinct_MI300X_OAM, AMD_Instinct_MI325_OAM), most specific first.
GPU_FIGURES: tuple[tuple[str, GpuFigures], ...] = (
    ("MI325", GpuFigures(6000, 1307.4)),  # the labeller writes MI325X as "MI325_OAM"
    ("MI300X", GpuFigures(5300, 1307.4)),  # not MI300A, the APU
    ("MI250X", GpuFigures(1638.4, 191.5)),  # one of the module's two dies: one amd.com/gpu
    ("MI210", GpuFigures(1638.4, 181)),
    ("H200", GpuFigures(4800, 989)),
    ("H100-PCIE", GpuFigures(2000, 756)),
    ("H100", GpuFigures(3350, 989)),  # SXM5 80GB HBM3
    ("A100-SXM4-80GB", GpuFigures(2039, 312)),
    ("A100-PCIE-80GB", GpuFigures(1935, 312)),
    ("A100", GpuFigures(1555, 312)),  # 40GB
    ("L40S", GpuFigures(864, 362)),
    ("L4", GpuFigures(300, 121)),
    ("A10", GpuFigures(600, 125)),
    ("T4", GpuFigures(320, 65)),
)


def gpu_figures(product: str | None) -> GpuFigures | None:
    name = (product or "").upper()
    return next((figures for key, figures in GPU_FIGURES if key in name), None)


def assumed_performance(
    product: str | None, profile: Profile, shape: ModelShape, context_tokens: float
) -> PoolPerformance | None:
    """The roofline estimate for one replica of `profile` on `product` GPUs at a mean context of
    `context_tokens` (prompt plus half the output); None for CPUs and GPUs without published figures here."""
    figures = gpu_figures(product)
    if figures is None or profile.device != "cuda":
        return None
    # Per stage: a replica that spans nodes runs its stages one after another for each token (pipeline parallel),
    # so a step reads every stage's weights and KV at one stage's bandwidth; its KV budget is a stage's.
    num_gpus, num_stages = max(profile.num_gpus, 1), profile.num_nodes
    bandwidth = figures.memory_bandwidth_gbps * 1e9 * DECODE_BANDWIDTH_EFFICIENCY * num_gpus
    kv_per_token = kv_bytes_per_token(shape, profile.dtype, num_gpus, num_stages, profile.kv_cache_dtype)
    context = max(context_tokens, 1.0)
    max_num_seqs = max(1, int(profile.kv_cache_bytes // (kv_per_token * context)))
    flops = figures.dense_tflops_16bit * 1e12 * PREFILL_FLOPS_EFFICIENCY * num_gpus
    return PoolPerformance(
        itl_alpha_s=profile.weight_bytes * num_stages / bandwidth,
        itl_beta_s=kv_per_token * num_stages * context / bandwidth,
        prefill_tokens_per_s=flops / (2 * active_parameters(shape)),
        max_num_seqs=max_num_seqs,
        source="assumed",
    )
