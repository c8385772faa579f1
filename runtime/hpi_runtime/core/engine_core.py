"""EngineCore: scheduler, KV cache manager and executor, stepped by one thread; token ids in, deltas out.

It knows nothing of text: requests arrive tokenized (`EngineCoreRequest`) and each step returns, per request
that changed, only what is new (`EngineCoreOutput`: new token ids, their logprobs, a finish reason). The
frontend (`OutputProcessor`) detokenizes, matches stop strings and aborts a request here when one matches.
The core runs in its own process under the server (core/core_process.py) and in the caller's process for the
offline `LLM` and for tests (frontend/engine.py); both drive the same object.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.block_pool import BlockHash, HashFn, sha256_hash
from hpi_runtime.core.engine_io import EngineCoreOutput, EngineCoreRequest, EngineStats
from hpi_runtime.core.interface import ExecutorDeadError, ModelExecutor, SchedulerOutput
from hpi_runtime.core.kv_budget import kv_tokens_per_request
from hpi_runtime.core.kv_cache_manager import KVCacheManager
from hpi_runtime.core.request import BlockHasher, Request, RequestStatus
from hpi_runtime.core.scheduler import Scheduler
from hpi_runtime.structured.compiler import GrammarCompiler


class QueueFullError(ValueError):
    """More requests are waiting than `max_num_waiting` allows (HTTP 429)."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode): it takes no request until woken (HTTP 503, like a replica that is
    not ready, so a router retries elsewhere)."""


class EngineBusyError(RuntimeError):
    """Sleep needs an idle engine: requests are running or waiting (HTTP 409)."""


class EngineError(RuntimeError):
    """A step failed; the requests in `request_ids` were finished and their blocks freed."""

    def __init__(self, message: str, request_ids: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.request_ids = frozenset(request_ids)


def check_images(config: EngineConfig, request: EngineCoreRequest) -> None:
    """ValueError for images this engine cannot take: none at all (a text-only model), or one whose embedding
    exceeds what the encoder may compute in one step or keep (it could never be scheduled)."""
    if not request.mm_inputs:
        return
    if not config.encoder_cache_size:
        raise ValueError("this model takes no images (it is a text-only model)")
    limit = min(config.encoder_cache_size, config.max_num_encoder_input_tokens)
    for mm in request.mm_inputs:
        if mm.length > limit:
            raise ValueError(f"an image of {mm.length} embedding tokens exceeds the encoder's limit of {limit} "
                             "(encoder_cache_size, max_num_encoder_input_tokens); send a smaller image")
        if mm.end > len(request.prompt_token_ids):
            raise ValueError(f"an image's placeholders {mm.offset}..{mm.end} lie outside the prompt")


def _encoder_stats(scheduler: Scheduler) -> dict:
    cache = scheduler.encoder_cache
    if cache is None:
        return {}
    return {"encoder_cache_queries": cache.num_queries, "encoder_cache_hits": cache.num_hits,
            "encoder_cache_usage": cache.usage}


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: ModelExecutor,
        eos_token_ids: frozenset[int],
        *,
        hash_fn: HashFn = sha256_hash,
        root_hash: BlockHash = b"",
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        """`grammar_compiler` serves requests with structured outputs; without one they are refused."""
        if executor.block_size != config.block_size:
            raise ValueError(f"executor block_size {executor.block_size} != config block_size {config.block_size}")
        num_blocks = executor.num_kv_blocks
        num_tokens_needed = kv_tokens_per_request(
            config.max_model_len, config.block_size, config.kv_sliding_window, config.max_num_batched_tokens
        )
        if num_blocks * config.block_size < num_tokens_needed:
            raise ValueError(
                f"{num_blocks} KV blocks of {config.block_size} tokens hold {num_blocks * config.block_size} "
                f"tokens, less than one request of max_model_len={config.max_model_len} needs ({num_tokens_needed})"
            )
        self.config = config
        self.executor = executor
        self.eos_token_ids = frozenset(eos_token_ids)
        self._hasher = BlockHasher(config.block_size, hash_fn, root_hash) if config.enable_prefix_caching else None
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            executor.num_host_kv_blocks,
            config.kv_sliding_window,
        )
        # vLLM's batch queue: an executor of pipeline stages runs this many batches at once (at least one per
        # stage), each submitted as it is scheduled and awaited oldest first; every other executor runs one step at
        # a time. The scheduler gives each batch its share of the requests.
        self.max_concurrent_batches = getattr(executor, "max_concurrent_batches", 1)
        self.scheduler = Scheduler(config, self.kv_cache_manager, batches_in_flight=self.max_concurrent_batches)
        self._batch_queue: deque[tuple[SchedulerOutput, Future]] = deque()
        self.grammar_compiler = grammar_compiler
        self.sleep_level = 0  # 0: awake; 1 or 2: asleep (see sleep())
        # Called when a step that prefills has been scheduled, before it runs (the core loop publishes the stats
        # then): such a step can take seconds (2,048 prompt tokens on a 2-core CPU: ~1.4 s), and stats published
        # only after it would show the requests it admitted as not running all that time.
        self.on_prefill_scheduled: Callable[[], None] | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        # The frontend's OutputProcessor refuses ids in use, and it forgets a request only after the core has.
        assert request.request_id not in self.scheduler.requests, f"request id {request.request_id!r} in use"
        if self.sleep_level:
            raise EngineSleepingError("the engine is asleep; wake it up (POST /wake_up) or retry on another replica")
        if len(self.scheduler.waiting) >= self.config.max_num_waiting:
            raise QueueFullError(
                f"{len(self.scheduler.waiting)} requests are waiting (max_num_waiting="
                f"{self.config.max_num_waiting}); retry later"
            )
        grammar = None
        if request.lora_request is not None and self.scheduler.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
        check_images(self.config, request)
        if (structured := request.sampling_params.structured_outputs) is not None:
            if self.grammar_compiler is None:
                raise ValueError("this engine serves no structured outputs (it has no grammar compiler)")
            grammar = self.grammar_compiler.matcher(structured)  # compiled once per grammar, then cached
        self.scheduler.add_request(
            Request(
                request.request_id,
                list(request.prompt_token_ids),
                request.sampling_params,
                max_tokens=request.max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=request.arrival_time,
                priority=request.priority,
                hasher=self._hasher,
                grammar=grammar,
                lora_request=request.lora_request,
                mm_inputs=request.mm_inputs,
            )
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests now and free their blocks; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def sleep(self, level: int) -> int:
        """vLLM's sleep mode: free the KV cache (level 1; on an accelerator the weights also move to host memory)
        or the KV cache and the weights (level 2, reloaded from the checkpoint on wake). Returns the bytes
        freed; 0 when already asleep (sleeping is idempotent; a deeper level does not deepen it).

        Only an idle engine sleeps (EngineBusyError otherwise, as vLLM requires): a running request would
        lose its KV. Every device block's cached hash is forgotten, since its KV is gone; the host KV tier
        keeps its blocks and their hashes, so prefixes offloaded there still hit after waking."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level:
            return 0
        if self.has_unfinished_requests():
            raise EngineBusyError(
                f"the engine is not idle ({len(self.scheduler.running)} running, {len(self.scheduler.waiting)} "
                "waiting); sleep when no request is in flight"
            )
        freed_bytes = self.executor.sleep(level)
        self.kv_cache_manager.reset_prefix_cache()
        self.sleep_level = level
        return freed_bytes

    def wake_up(self) -> int:
        """Restore what sleep released (the same KV blocks, the same weights); returns the bytes restored, 0 when
        awake already (idempotent)."""
        if not self.sleep_level:
            return 0
        restored_bytes = self.executor.wake_up()
        self.sleep_level = 0
        return restored_bytes

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model and process its output. Raises EngineError if the step failed; its
        requests are then finished and freed and the core stays usable. ExecutorDeadError passes through:
        the executor is gone and the core with it."""
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self._announce(scheduler_output)
        try:
            start = time.perf_counter()
            model_output = self.executor.execute_model(scheduler_output)
            if (policy := self.scheduler.spec_policy) is not None:  # the step-time curve speculation reads
                policy.step_times.record(scheduler_output.total_num_scheduled_tokens, time.perf_counter() - start)
            return self.scheduler.update_from_output(scheduler_output, model_output)
        except ExecutorDeadError:  # not this step's fault, and no later step can run: the core is over
            self.scheduler.fail_scheduled(scheduler_output)
            raise
        except Exception as exc:
            failed_ids = self.scheduler.fail_scheduled(scheduler_output)
            raise EngineError(f"engine step failed for requests {sorted(failed_ids)}: {exc!r}", failed_ids) from exc

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Pipeline stages: submit a new batch while the queue has room (requests in flight are not scheduled
        again), and process the oldest batch's output once the queue is full or nothing new could be scheduled,
        so every stage has a batch to work on. Any failure ends the executor (ExecutorDeadError): the stages run
        different batches, so no step can fail alone; every batch in flight fails with it."""
        queue = self._batch_queue
        submitted = False
        if len(queue) < self.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                self._announce(scheduler_output)
                queue.append((scheduler_output, self.executor.submit(scheduler_output)))
                submitted = True
        if not queue or (submitted and len(queue) < self.max_concurrent_batches and not queue[0][1].done()):
            return []
        scheduler_output, future = queue.popleft()
        try:
            model_output = future.result()
        except BaseException:
            self.scheduler.fail_scheduled(scheduler_output)
            while queue:
                self.scheduler.fail_scheduled(queue.popleft()[0])
            raise
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _announce(self, scheduler_output: SchedulerOutput) -> None:
        """on_prefill_scheduled() for a step with prompt tokens: more tokens than one per request and its drafts
        (a speculative decode step's drafts alone do not make it long)."""
        if self.on_prefill_scheduled is None:
            return
        so = scheduler_output
        num_drafts = sum(len(drafts) for drafts in so.spec_token_ids.values())
        if so.total_num_scheduled_tokens > len(so.num_scheduled_tokens) + num_drafts:
            self.on_prefill_scheduled()

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def get_stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        host = kv.host
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens=scheduler.num_prompt_tokens,
            num_generation_tokens=scheduler.num_generation_tokens,
            num_swapped_preemptions=scheduler.num_swapped_preemptions,
            num_prefill_tokens_computed=scheduler.num_prefill_tokens_computed,
            prefix_cache_host_hits=kv.prefix_cache_host_hits,
            kv_host_usage=host.usage if host is not None else 0.0,
            kv_host_cached_blocks=host.num_cached_blocks if host is not None else 0,
            kv_blocks_to_host=host.num_blocks_to_host if host is not None else 0,
            kv_blocks_to_device=host.num_blocks_to_device if host is not None else 0,
            **(scheduler.spec_policy.stats.as_engine_stats() if scheduler.spec_policy is not None else {}),
            **scheduler.lora_stats(),
            **_encoder_stats(scheduler),
            pipeline_stage_busy_s=self.executor.stage_busy_s(),
        )

    def shutdown(self) -> None:
        """Abort everything (freeing its blocks) and stop the executor."""
        self.abort_requests(list(self.scheduler.requests))
        self.executor.shutdown()

