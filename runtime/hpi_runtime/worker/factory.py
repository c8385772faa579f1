"""make_executor: the executor a config asks for (the model in this process, one worker per TP rank, or the
leader of a pipeline group that may span hosts)."""

from __future__ import annotations

import os

from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.pp_executor import PipelineExecutor
from hpi_runtime.worker.pp_layout import resolve_layout
from hpi_runtime.worker.tp_executor import MultiprocExecutor


def make_executor(config: ExecutorConfig) -> LocalExecutor | MultiprocExecutor | PipelineExecutor:
    """Load the model and allocate its KV cache: `LocalExecutor` at tensor_parallel_size 1, one worker process
    per rank (gloo on CPU, NCCL on CUDA devices 0..N-1) above it, and a `PipelineExecutor` with several pipeline
    stages or hosts (worker/pp_layout.py)."""
    if resolve_layout(config.parallel, os.environ).is_distributed:
        return PipelineExecutor(config)
    return LocalExecutor(config) if config.parallel.tensor_parallel_size == 1 else MultiprocExecutor(config)
