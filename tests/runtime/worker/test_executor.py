"""LocalExecutor's KV sizing: each rank's bytes per token come from the one formula in hpi_contracts.kv_cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_contracts.kv_cache import kv_bytes_per_token
from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.models.config import ModelConfig, RopeConfig
from hpi_runtime.models.llama import LlamaForCausalLM
from hpi_runtime.models.parallel import TensorParallel, split_heads
from hpi_runtime.worker.executor import rank_kv_bytes_per_token

# SmolLM2's head layout (9 query, 3 KV heads) at toy width: 2 ranks hold 2 + 1 KV heads, 9 ranks replicate them.
CONFIG = ModelConfig(
    model_dir=Path("tiny"), architecture="LlamaForCausalLM", vocab_size=64, hidden_size=72, intermediate_size=288,
    num_layers=3, num_heads=9, num_kv_heads=3, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=128,
    rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, qkv_bias=False, o_proj_bias=False, mlp_bias=False,
    torch_dtype="float32", sliding_window=None, eos_token_ids=frozenset({0}), bos_token_id=None,
)  # fmt: skip


def _model(tp: TensorParallel) -> LlamaForCausalLM:
    with torch.device("meta"):  # shapes only: nothing allocated
        return LlamaForCausalLM(CONFIG, get_attention_backend("torch", torch.bfloat16), tp)


def test_single_rank_matches_the_model_config():
    per_token = rank_kv_bytes_per_token(_model(TensorParallel()), torch.bfloat16)
    assert per_token == CONFIG.kv_bytes_per_token(2) == kv_bytes_per_token(3, 3, 8, 2) == 2 * 3 * 3 * 8 * 2


@pytest.mark.parametrize("tp_size", [2, 3, 9])
def test_each_rank_counts_only_the_kv_heads_it_holds(tp_size):
    for rank in range(tp_size):
        num_kv_heads = split_heads(9, 3, tp_size, rank).kv.size
        model = _model(TensorParallel(rank=rank, size=tp_size))
        assert rank_kv_bytes_per_token(model, torch.float32) == kv_bytes_per_token(3, num_kv_heads, 8, 4)
