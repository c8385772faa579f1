"""The runtime treats an AMD GPU under torch's ROCm build as a GPU: device "auto" picks it and the Triton attention
path serves it. Simulated, with no GPU here: the decision is a pure function of what torch reports
(`torch.version.cuda`, `torch.version.hip`, the device count), so these tests hand it a ROCm build's answers."""

from __future__ import annotations

import pytest
import torch

from hpi_runtime.gpu_platform import current_gpu_platform, default_attention_backend, gpu_platform, resolve_device

# What torch 2.x's ROCm wheels report: a HIP version, no CUDA version (torch.version.cuda is None there).
ROCM = gpu_platform(cuda_version=None, hip_version="6.4.43482", num_devices=8)


def test_a_rocm_build_is_a_gpu_platform_under_cudas_device_name() -> None:
    assert (ROCM.name, ROCM.gpu_visible) == ("rocm", True)
    assert resolve_device("auto", ROCM) == torch.device("cuda")  # HIP devices are torch's "cuda" device type
    assert resolve_device("cuda", ROCM) == torch.device("cuda")
    assert default_attention_backend(resolve_device("auto", ROCM)) == "triton"
    assert "ROCm (HIP) 6.4.43482, 8 GPU(s)" in ROCM.describe()


def test_without_a_visible_gpu_auto_is_cpu_and_cuda_says_what_torch_offers() -> None:
    rocm_without_gpu = gpu_platform(None, "6.4.43482", 0)
    assert resolve_device("auto", rocm_without_gpu) == torch.device("cpu")
    assert default_attention_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match=r"no GPU is visible \(ROCm \(HIP\) 6.4.43482, 0 GPU"):
        resolve_device("cuda", rocm_without_gpu)
    with pytest.raises(ValueError, match="a CPU-only torch build"):
        resolve_device("cuda", gpu_platform(None, None, 0))
    assert gpu_platform("12.8", None, 1).name == "cuda"


def test_this_machines_platform_matches_torch() -> None:
    platform = current_gpu_platform()
    assert platform.gpu_visible == torch.cuda.is_available()
    assert platform.name == ("rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu")
