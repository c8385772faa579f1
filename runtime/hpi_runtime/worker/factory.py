"""make_executor: the executor a config asks for (the model in this process, or one worker per TP rank)."""

from __future__ import annotations

from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.tp_executor import MultiprocExecutor


def make_executor(config: ExecutorConfig) -> LocalExecutor | MultiprocExecutor:
    """Load the model and allocate its KV cache: `LocalExecutor` at tensor_parallel_size 1, else one worker
    process per rank (gloo on CPU, NCCL on CUDA devices 0..N-1)."""
    return LocalExecutor(config) if config.parallel.tensor_parallel_size == 1 else MultiprocExecutor(config)
