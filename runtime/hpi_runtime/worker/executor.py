"""LocalExecutor: the model, its paged KV cache and the runner in this process (a `ModelExecutor`).

Tensor-parallel executors will implement the same protocol over several worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpi_runtime.core.interface import ModelRunnerOutput, SchedulerOutput
from hpi_runtime.core.kv_budget import num_blocks_for_budget
from hpi_runtime.model.attention import get_attention_backend
from hpi_runtime.model.config import ModelConfig
from hpi_runtime.model.loader import load_model, weight_bytes
from hpi_runtime.model.quantization import QuantizationConfig, quantize_model
from hpi_runtime.worker.model_runner import KVCacheSpec, ModelRunner, allocate_kv_caches


@dataclass(frozen=True)
class ExecutorConfig:
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_model_len: int
    kv_cache_memory_bytes: int  # the KV cache gets as many blocks as fit in this
    attention_backend: str = "torch"
    seed: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # banned before a request's min_tokens
    quantization: QuantizationConfig = QuantizationConfig()  # weight-only int8/int4, applied after loading


class LocalExecutor:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        model_config = config.model_config
        backend = get_attention_backend(config.attention_backend, config.dtype)
        self.model = load_model(model_config, config.dtype, config.device, backend)
        quantize_model(self.model, config.quantization)  # in place, one layer at a time
        self.weight_bytes = weight_bytes(self.model)
        dtype_bytes = torch.empty(0, dtype=config.dtype).element_size()
        self._num_kv_blocks = num_blocks_for_budget(
            config.kv_cache_memory_bytes,
            model_config.kv_bytes_per_token(dtype_bytes),
            config.block_size,
            config.max_model_len,
        )
        self.kv_cache_bytes = allocate_kv_caches(
            self.model, KVCacheSpec(self._num_kv_blocks, config.block_size, config.dtype), config.device
        )
        eos_token_ids = config.eos_token_ids or model_config.eos_token_ids
        self.runner = ModelRunner(self.model, backend, config.block_size, eos_token_ids, config.seed)

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.runner.requests.clear()
