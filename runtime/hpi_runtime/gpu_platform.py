"""Which GPU platform this torch build drives: CUDA (NVIDIA) or ROCm (AMD, through HIP), and whether a GPU is visible.

torch's ROCm build keeps CUDA's names: the device type is "cuda", `torch.cuda.is_available()` is true on an AMD
GPU, NCCL calls go to RCCL, and Triton compiles the same kernels for the AMD backend. What tells the builds apart is
`torch.version.hip` (set, with `torch.version.cuda` None, on ROCm). So every place that asks "is this a GPU" asks
for the device type "cuda" and works on both; this module only names the platform, for the messages a user reads
("no GPU visible to this ROCm build") and for logs. The decision is a pure function of the three facts torch
reports, so it is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuPlatform:
    name: str  # "cuda", "rocm", or "cpu" (a CPU-only torch build)
    version: str | None  # the CUDA or HIP version torch was built against
    num_devices: int  # GPUs visible to this process

    @property
    def gpu_visible(self) -> bool:
        return self.name != "cpu" and self.num_devices > 0

    def describe(self) -> str:
        if self.name == "cpu":
            return "a CPU-only torch build"
        label = {"cuda": "CUDA", "rocm": "ROCm (HIP)"}[self.name]
        return f"{label} {self.version}, {self.num_devices} GPU(s) visible"


def gpu_platform(cuda_version: str | None, hip_version: str | None, num_devices: int) -> GpuPlatform:
    """`torch.version.cuda`, `torch.version.hip` and `torch.cuda.device_count()` -> the platform. HIP wins: a ROCm
    build sets only it, and it is the one fact that says the kernels run on an AMD GPU."""
    if hip_version:
        return GpuPlatform("rocm", hip_version, num_devices)
    if cuda_version:
        return GpuPlatform("cuda", cuda_version, num_devices)
    return GpuPlatform("cpu", None, 0)


def current_gpu_platform() -> GpuPlatform:
    """This process's platform, as torch reports it."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpu_platform(torch.version.cuda, getattr(torch.version, "hip", None), count)


def resolve_device(device: str, platform: GpuPlatform) -> torch.device:
    """"auto": the GPU (device type "cuda", on CUDA and ROCm alike) when one is visible, else cpu. ValueError for
    an explicit "cuda" without one, naming what torch offers."""
    if device == "auto":
        return torch.device("cuda" if platform.gpu_visible else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not platform.gpu_visible:
        raise ValueError(f"device='cuda' requested but no GPU is visible ({platform.describe()})")
    return resolved


def default_attention_backend(device: torch.device) -> str:
    """The Triton kernels on a GPU, CUDA or ROCm (Triton targets both); the torch backend (the reference, and the
    C++ CPU kernel) on CPU."""
    return "triton" if device.type == "cuda" else "torch"
