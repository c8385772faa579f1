"""LLMEngine: the synchronous engine loop (add_request -> step -> RequestOutputs) around one executor.

step() may run in one thread while add_request / abort_request / get_stats are called from another (the
AsyncLLM front does exactly that): a lock guards the scheduler's state but is not held during the model
forward, so an abort frees its blocks at once even while a step is running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.block_pool import BlockHash, HashFn, sha256_hash
from hpi_runtime.core.detokenizer import IncrementalDetokenizer
from hpi_runtime.core.interface import ExecutorDeadError, ModelExecutor
from hpi_runtime.core.kv_cache_manager import KVCacheManager
from hpi_runtime.core.request import BlockHasher, Request, RequestStatus
from hpi_runtime.core.scheduler import Scheduler
from hpi_runtime.outputs import RequestOutput
from hpi_runtime.sampling_params import SamplingParams


class QueueFullError(ValueError):
    """More requests are waiting than `max_num_waiting` allows (HTTP 429)."""


class EngineError(RuntimeError):
    """A step failed; the requests in `request_ids` were finished and their blocks freed."""

    def __init__(self, message: str, request_ids: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.request_ids = frozenset(request_ids)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use over all blocks (cached free blocks count as free)
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int


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
    ) -> None:
        if executor.block_size != config.block_size:
            raise ValueError(f"executor block_size {executor.block_size} != config block_size {config.block_size}")
        num_blocks = executor.num_kv_blocks
        if num_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"{num_blocks} KV blocks of {config.block_size} tokens hold {num_blocks * config.block_size} "
                f"tokens, less than one request of max_model_len={config.max_model_len}"
            )
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._hasher = BlockHasher(config.block_size, hash_fn, root_hash) if config.enable_prefix_caching else None
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        self._lock = threading.Lock()
        self._pending_outputs: list[RequestOutput] = []  # abort outputs, returned by the next step()

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate a request against the config (not against the queues) and build it."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if num_prompt >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt} tokens does not fit max_model_len={self.config.max_model_len} "
                "(at least one output token must fit)"
            )
        return Request(
            request_id,
            list(prompt_token_ids),
            sampling_params,
            max_tokens=min(sampling_params.max_tokens, self.config.max_model_len - num_prompt),
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            hasher=self._hasher,
            detokenizer=None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling_params),
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; among waiting ones a lower `priority` is admitted first (vLLM's convention)."""
        request = self.make_request(request_id, prompt_token_ids, sampling_params, arrival_time, priority)
        with self._lock:
            if request_id in self.scheduler.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            if len(self.scheduler.waiting) >= self.config.max_num_waiting:
                raise QueueFullError(
                    f"{len(self.scheduler.waiting)} requests are waiting (max_num_waiting="
                    f"{self.config.max_num_waiting}); retry later"
                )
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        with self._lock:
            outputs = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.extend(outputs)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model and process its output. Raises EngineError if the step failed; its
        requests are then finished and freed and the engine stays usable. ExecutorDeadError passes through:
        the executor is gone and the engine with it."""
        with self._lock:
            outputs, self._pending_outputs = self._pending_outputs, []
            scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return outputs
        try:
            model_output = self.executor.execute_model(scheduler_output)
            with self._lock:
                return outputs + self.scheduler.update_from_output(scheduler_output, model_output)
        except ExecutorDeadError:  # not this step's fault, and no later step can run: the engine is over
            with self._lock:
                self.scheduler.fail_scheduled(scheduler_output)
            raise
        except Exception as exc:
            with self._lock:
                failed_ids = self.scheduler.fail_scheduled(scheduler_output)
                self._pending_outputs[:0] = outputs
            raise EngineError(f"engine step failed for requests {sorted(failed_ids)}: {exc!r}", failed_ids) from exc

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests or self._pending_outputs)

    def get_stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        with self._lock:
            return EngineStats(
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                kv_cache_usage=kv.usage,
                prefix_cache_queries=kv.prefix_cache_queries,
                prefix_cache_hits=kv.prefix_cache_hits,
                num_preemptions=scheduler.num_preemptions,
                num_prompt_tokens=scheduler.num_prompt_tokens,
                num_generation_tokens=scheduler.num_generation_tokens,
            )

    def shutdown(self) -> None:
        """Abort everything (freeing its blocks) and stop the executor."""
        self.abort_request(list(self.scheduler.requests))
        self.executor.shutdown()
