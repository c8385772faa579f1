"""The KV-cache contract: one list of block sizes and one bytes-per-token formula for runtime and operator."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpi_contracts.kv_cache import BLOCK_SIZES, KV_CACHE_DTYPES, kv_bytes_per_token, kv_cache_dtype_bytes

REPO = Path(__file__).resolve().parents[2]


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16.
    assert kv_bytes_per_token(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2 == 23_040


def test_the_crd_offers_exactly_the_block_sizes_the_runtime_accepts() -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferencedeployments.serving.hpi.dev.yaml").read_text())
    [version] = crd["spec"]["versions"]
    engine = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert tuple(engine["properties"]["blockSize"]["enum"]) == BLOCK_SIZES


def test_the_crd_offers_exactly_the_kv_cache_dtypes_the_runtime_accepts() -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferencedeployments.serving.hpi.dev.yaml").read_text())
    [version] = crd["spec"]["versions"]
    engine = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert tuple(engine["properties"]["kvCacheDtype"]["enum"]) == KV_CACHE_DTYPES


def test_kv_cache_dtype_bytes() -> None:
    """auto: the model's; bfloat16: two bytes whatever the model computes in (half an fp32 model's); fp8: one."""
    assert [kv_cache_dtype_bytes(name, 4) for name in KV_CACHE_DTYPES] == [4, 2, 1, 1, 1]
    assert kv_cache_dtype_bytes("bfloat16", 2) == kv_cache_dtype_bytes("auto", 2) == 2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        kv_cache_dtype_bytes("int8", 2)
