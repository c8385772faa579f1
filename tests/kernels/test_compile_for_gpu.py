"""Every kernel compiles for real GPU targets without one: the interpreter misses compile-only errors.

Triton's interpreter runs kernels as NumPy and accepts code the compiler rejects (tl.dot below its
minimum tile sizes, loop-carried type changes, bad casts). Triton can compile ahead of time for a
target with the ptxas its wheel ships, so CI compiles one launch configuration of each kernel in a
subprocess with the interpreter off. The same wheel carries the AMD backend, whose LLVM and linker are
built into libtriton: the kernels compile to HSA code objects for AMD Instinct GPUs too (gfx942: MI300X and
MI325X; gfx90a: MI250X and MI210), with their 64-wide wavefronts, which is what the runtime runs on torch's
ROCm build. Run as a script (`... 90` or `... gfx942`), this file does the compiling.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# (kernel module, kernel name, pointer dtypes, constexprs, num_warps): what the launchers pick for bf16.
_BF16 = "*bf16"
CONFIGS = [
    (
        "kv_cache", "_write_kv_cache_kernel", {"slot_mapping_ptr": "*i64"},
        {"BLOCK_SIZE": 16, "BLOCK_H": 4, "BLOCK_D": 64, "FP8_MANTISSA": 0, "FP8_BIAS": 0, "FP8_MAX": 0.0,
         "BF16": False}, 4,
    ),
    # `--kv-cache-dtype bfloat16` under an fp32 model: fp32 rows rounded into the bf16 cache, fp32 queries over it.
    (
        "kv_cache", "_write_kv_cache_kernel", {"slot_mapping_ptr": "*i64", "key_ptr": "*fp32", "value_ptr": "*fp32"},
        {"BLOCK_SIZE": 16, "BLOCK_H": 4, "BLOCK_D": 64, "FP8_MANTISSA": 0, "FP8_BIAS": 0, "FP8_MAX": 0.0,
         "BF16": True}, 4,
    ),
    (
        "paged_attention", "_decode_kernel",
        {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_ptr": "*fp32", "out_ptr": "*fp32",
         "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"},
        {"BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_D": 64, "BLOCK_N": 64, "SPLIT": True, "SOFTCAP": False,
         "UPCAST": True}, 4,
    ),
    (
        "paged_attention", "_decode_kernel",
        {
            "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
            "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
        },
        {"BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_D": 64, "BLOCK_N": 64, "SPLIT": True, "SOFTCAP": True,
         "UPCAST": False}, 4,
    ),
    (
        "paged_attention", "_reduce_splits_kernel", {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"},
        {"BLOCK_S": 4, "BLOCK_D": 64}, 4,
    ),
    (
        "prefill_attention", "_prefill_kernel",
        {"block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "context_lens_ptr": "*i32"},
        {"BLOCK_SIZE": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 64, "SOFTCAP": True, "UPCAST": False}, 4,
    ),
    # Decode tiles writing split-K partials, prefill-sized tiles writing the output; the prefill path's passes.
    (
        "quant_matmul", "_int8_matmul_kernel", {"weight_ptr": "*i8", "out_ptr": "*fp32"},
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "PARTIAL": True, "UPCAST": False}, 4,
    ),
    (
        "quant_matmul", "_int8_matmul_kernel", {"weight_ptr": "*i8"},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "PARTIAL": False, "UPCAST": False}, 4,
    ),
    (
        "quant_matmul", "_int4_matmul_kernel", {"packed_ptr": "*u8", "out_ptr": "*fp32"},
        {"GROUP_SIZE": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "PARTIAL": True, "UPCAST": False}, 4,
    ),
    (
        "quant_matmul", "_int4_matmul_kernel", {"packed_ptr": "*u8"},
        {"GROUP_SIZE": 32, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "PARTIAL": False, "UPCAST": False}, 4,
    ),
    ("quant_matmul", "_dequant_int8_kernel", {"weight_ptr": "*i8"}, {"BLOCK_N": 32, "BLOCK_K": 256}, 4),
    ("quant_matmul", "_dequant_int4_kernel", {"packed_ptr": "*u8"}, {"GROUP_SIZE": 32, "BLOCK": 2048}, 4),
    (
        "fused_moe", "_fused_moe_kernel",
        {"topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32"},
        {"TOP_K": 2, "MUL_ROUTED_WEIGHT": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "UPCAST": False}, 4,
    ),
    (
        "fused_moe", "_fused_moe_kernel",
        {"topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32"},
        {"TOP_K": 1, "MUL_ROUTED_WEIGHT": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "UPCAST": False}, 4,
    ),
    ("lora", "_lora_bgmv_kernel", {"slot_ids_ptr": "*i64"}, {"ACCUMULATE": True, "BLOCK_N": 64, "BLOCK_K": 128}, 4),
]


# `--kv-cache-dtype fp8*` (one-byte caches): CUDA only, where Triton has both formats from sm_89 (e4m3 is fp8e4nv);
# AMD's Instinct GPUs take other fp8 variants (fnuz), which the runtime does not use.
_KV = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32"}
FP8_CONFIGS = [
    (
        "kv_cache", "_write_kv_cache_kernel", {"slot_mapping_ptr": "*i64", "k_cache_ptr": "*fp8e4nv",
                                               "v_cache_ptr": "*fp8e4nv"},
        {"BLOCK_SIZE": 16, "BLOCK_H": 4, "BLOCK_D": 64, "FP8_MANTISSA": 3, "FP8_BIAS": 7, "FP8_MAX": 448.0,
         "BF16": False}, 4,
    ),
    (
        "kv_cache", "_write_kv_cache_kernel", {"slot_mapping_ptr": "*i64", "k_cache_ptr": "*fp8e5",
                                               "v_cache_ptr": "*fp8e5"},
        {"BLOCK_SIZE": 16, "BLOCK_H": 4, "BLOCK_D": 64, "FP8_MANTISSA": 2, "FP8_BIAS": 15, "FP8_MAX": 57344.0,
         "BF16": False}, 4,
    ),
    (
        "paged_attention", "_decode_kernel",
        {**_KV, "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "k_cache_ptr": "*fp8e4nv",
         "v_cache_ptr": "*fp8e4nv"},
        {"BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_D": 64, "BLOCK_N": 64, "SPLIT": True, "SOFTCAP": False,
         "UPCAST": False}, 4,
    ),
    (
        "prefill_attention", "_prefill_kernel",
        {**_KV, "query_start_loc_ptr": "*i32", "k_cache_ptr": "*fp8e5", "v_cache_ptr": "*fp8e5"},
        {"BLOCK_SIZE": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 64, "SOFTCAP": False, "UPCAST": False}, 4,
    ),
]


def _configs(arch: str) -> list:
    return CONFIGS if arch.startswith("gfx") else CONFIGS + FP8_CONFIGS


def _target(arch: str):
    """"90" -> CUDA sm_90 (32-wide warps); "gfx942" -> AMD's HIP target (64-wide wavefronts)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)


def _compile_all(arch: str) -> None:
    import importlib

    import triton
    from triton.compiler import ASTSource

    for module, name, pointers, constexprs, num_warps in _configs(arch):
        kernel = getattr(importlib.import_module(f"hpi_kernels.{module}"), name)
        signature = {}
        for arg in kernel.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = pointers.get(arg, _BF16)
            else:
                signature[arg] = "fp32" if arg.startswith(("scale", "softcap")) else "i32"
        source = ASTSource(
            fn=kernel,
            signature=signature,
            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
        )
        triton.compile(source, target=_target(arch), options={"num_warps": num_warps})
        print(f"compiled {name} for {arch}")


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    from triton.backends.nvidia import compiler

    if not Path(compiler.__file__).parent.joinpath("bin", "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=500
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("compiled") == len(_configs("90"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_kernels_compile_for_amd_instinct(arch: str) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.amd.compiler", reason="this triton wheel has no AMD backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__, arch], env=env, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("compiled") == len(CONFIGS)


if __name__ == "__main__":
    _compile_all(sys.argv[1])
