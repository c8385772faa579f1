"""LLMEngine: the synchronous engine (add_request -> step -> RequestOutputs) with its core in this process.

The offline `LLM` and the engine tests use it: frontend (request validation, detokenizing, stop strings) and
`EngineCore` driven by the caller's thread, one step at a time. The server runs the same two halves with the
core in its own process (frontend/async_engine.py, core/core_process.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.block_pool import BlockHash, HashFn, sha256_hash
from hpi_runtime.core.engine_core import EngineCore, EngineError, QueueFullError
from hpi_runtime.core.engine_io import EngineCoreRequest, EngineStats
from hpi_runtime.core.interface import ModelExecutor
from hpi_runtime.frontend.input_processor import make_core_request
from hpi_runtime.frontend.output_processor import OutputProcessor
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.outputs import RequestOutput, RequestOutputKind
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.structured.compiler import GrammarCompiler

__all__ = ["EngineError", "EngineStats", "LLMEngine", "QueueFullError"]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: ModelExecutor,
        tokenizer,
        eos_token_ids: frozenset[int],
        *,
        hash_fn: HashFn = sha256_hash,
        root_hash: BlockHash = b"",
        vocab_size: int | None = None,
    ) -> None:
        """`vocab_size`: the width of the model's logits (for grammar bitmasks; None: the tokenizer's length)."""
        grammar_compiler = GrammarCompiler(lambda: tokenizer, vocab_size, frozenset(eos_token_ids))
        self.core = EngineCore(config, executor, eos_token_ids, hash_fn=hash_fn, root_hash=root_hash,
                               grammar_compiler=grammar_compiler)
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self._pending_outputs: list[RequestOutput] = []  # abort outputs, returned by the next step()

    # The core's parts, for callers that inspect them (tests, benchmarks).
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def executor(self) -> ModelExecutor:
        return self.core.executor

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.kv_cache_manager

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> EngineCoreRequest:
        """Validate a request against the config (not against the queues) and build it."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        return make_core_request(self.config, request_id, prompt_token_ids, sampling_params, arrival_time, priority,
                                 lora_request, mm_inputs)  # fmt: skip

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> None:
        """Queue a request; among waiting ones a lower `priority` is admitted first (vLLM's convention).
        `lora_request`: the adapter to run it with (checked by the caller: lora/registry.py). `mm_inputs`: its
        images (multimodal/processor.py)."""
        request = self.make_request(request_id, prompt_token_ids, sampling_params, arrival_time, priority,
                                    lora_request, mm_inputs)  # fmt: skip
        self.output_processor.add_request(request, output_kind)  # refuses an id in use
        try:
            self.core.add_request(request)
        except BaseException:  # queue full, or a grammar the core cannot compile: the request never existed
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        request_ids = list(request_ids)
        self.core.abort_requests(request_ids)
        self._pending_outputs.extend(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model and turn its output into RequestOutputs. Raises EngineError if the step
        failed (its requests are finished and freed; the engine stays usable); ExecutorDeadError passes through."""
        outputs, self._pending_outputs = self._pending_outputs, []
        try:
            core_outputs = self.core.step()
        except EngineError as exc:
            self.output_processor.abort_requests(exc.request_ids)
            self._pending_outputs[:0] = outputs
            raise
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.request_ids_to_abort:  # stop strings: free their blocks before the next step
            self.core.abort_requests(processed.request_ids_to_abort)
        return outputs + processed.outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.core.has_unfinished_requests() or self._pending_outputs or len(self.output_processor))

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def shutdown(self) -> None:
        """Abort everything (freeing its blocks) and stop the executor."""
        self.core.shutdown()
