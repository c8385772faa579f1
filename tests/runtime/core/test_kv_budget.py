"""KV memory budget -> number of blocks, with a clear error when one max-length request cannot fit."""

from __future__ import annotations

import pytest

from hpi_contracts.kv_cache import kv_bytes_per_token
from hpi_runtime.core.kv_budget import num_blocks_for_budget


def test_smollm2_budget_in_bf16():
    per_token = kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
    assert per_token == 23_040
    assert num_blocks_for_budget(1 << 30, per_token, 16, 2048) == (1 << 30) // (per_token * 16) == 2912


def test_exactly_one_max_length_request_fits():
    assert num_blocks_for_budget(100 * 16 * 8, 100, 16, 128) == 8
    assert num_blocks_for_budget(100 * 16 * 8, 100, 16, 121) == 8  # 121 tokens round up to 8 blocks


def test_too_small_budget_names_the_numbers():
    with pytest.raises(ValueError) as info:
        num_blocks_for_budget(100 * 16 * 7 + 99, 100, 16, 128)
    message = str(info.value)
    for number in ("11299 bytes", "7 blocks", "max_model_len=128", "needs 8 blocks", "12800 bytes"):
        assert number in message


@pytest.mark.parametrize("field", range(4))
def test_non_positive_inputs_are_refused(field):
    args = [1 << 20, 100, 16, 128]
    args[field] = 0
    with pytest.raises(ValueError, match="must be positive"):
        num_blocks_for_budget(*args)
