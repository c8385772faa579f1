"""The C++ CPU kernels' AVX2 and generic builds, on any machine above them: the kernel tests again, in one child
per capability whose torch dispatches to that lower instruction set (conftest.run_at_lower_capability). One child
for all four kernel files, not one each: a child's start (Python, torch, pytest, the build's load) is most of what
a file's re-run costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_at_lower_capability, run_in_child

HERE = Path(__file__).parent
# Per file, the tests re-run (-k names the module, so one expression selects per file): attention's mixed-batch
# cases that cover both kernels and the build check; every test of the others.
SELECTION = (
    "(test_cpu_attention and ((mixed_batch and (gqa9 or mha) and 16) or long_chunks or fused or fp8 or bf16_cache "
    "or decode_head_dims or built_for)) or "
    "test_cpu_packed_linear or test_cpu_quant_linear or test_cpu_lora"
)
FILES = ["test_cpu_attention.py", "test_cpu_packed_linear.py", "test_cpu_quant_linear.py", "test_cpu_lora.py"]


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_lower_capability_builds_agree(capability) -> None:
    """Attention (mixed batches, long chunks, fused, fp8 and bf16 caches), packed fp32/bf16 linears (other panel
    widths and register tiles), quantized linears (widening) and the LoRA delta (vector widths, pair widening) under
    each build."""
    run_at_lower_capability([str(HERE / name) for name in FILES], capability, SELECTION)


@pytest.mark.slow
def test_avx2_build_without_avx_vnni_agrees() -> None:
    """On a CPU with AVX-VNNI the AVX2 build's W4A8 / W8A8 take their AVX-VNNI tiles (the child run above); with
    HPI_CPU_AVX_VNNI=0 they take the vpmaddubsw and portable tiles that an AVX2-only CPU runs, checked here too."""
    if "avx_vnni" not in set(Path("/proc/cpuinfo").read_text().split()):
        pytest.skip("no AVX-VNNI on this CPU: the AVX2 child run above already takes the tiles without it")
    run_at_lower_capability([str(HERE / "test_cpu_quant_linear.py")], "AVX2", "a8", {"HPI_CPU_AVX_VNNI": "0"})


@pytest.mark.slow
def test_avx512_build_without_vbmi_agrees() -> None:
    """On a CPU with AVX512-VNNI and -VBMI, W8A8 takes the vpermi2b tile; with HPI_CPU_AVX512_VBMI=0 it takes the
    unpack tile that CPUs with VNNI alone (Cascade Lake) run, checked here too."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if not {"avx512_vnni", "avx512vbmi"} <= flags:
        pytest.skip("no AVX512-VNNI with -VBMI on this CPU: the main run already takes the tile without VBMI, or none")
    run_in_child([str(HERE / "test_cpu_quant_linear.py")], "a8", {"HPI_CPU_AVX512_VBMI": "0"})


@pytest.mark.slow
def test_avx512_build_without_bf16_agrees() -> None:
    """On a CPU with AVX512-BF16 the LoRA delta stores bf16 sums with vcvtne2ps2bf16; with HPI_CPU_AVX512_BF16=0 it
    rounds them in integers, as on CPUs without it (Cascade Lake), checked here too."""
    if "avx512_bf16" not in set(Path("/proc/cpuinfo").read_text().split()):
        pytest.skip("no AVX512-BF16 on this CPU: the main run already takes the paths without it")
    run_in_child([str(HERE / "test_cpu_lora.py")], "matches or writes_only", {"HPI_CPU_AVX512_BF16": "0"})
