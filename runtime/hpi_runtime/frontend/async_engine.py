"""AsyncLLM: the asyncio frontend of the engine. Outputs stream per request; the core runs elsewhere.

The frontend validates requests, keeps each one's detokenizer and stop strings (`OutputProcessor`) and feeds
per-request asyncio queues; the engine core runs in its own process (`ProcessCoreClient`, the server's
setup) or in a thread (`ThreadCoreClient`, for tests) and sends back deltas. Everything here runs on the
event loop: core messages arrive through a reader callback, so there is no lock and no thread.

A consumer that stops iterating (or whose task is cancelled) aborts its request; the core frees its blocks
before its next step. A stop string ends a request here at once and aborts it in the core. A failed step
fails only its own requests (their iterators raise `EngineError`); a core that dies (its process killed,
its executor gone) fails every request with `EngineDeadError`, `errored` turns true and `wait_dead()`
returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.engine_core import EngineBusyError, EngineCore, EngineError, EngineSleepingError, QueueFullError
from hpi_runtime.core.engine_io import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreInfo,
    CoreOutputs,
    EngineStats,
    RequestRejected,
    Sleep,
    SleepAnswer,
    StepFailed,
    WakeUp,
)
from hpi_runtime.frontend.input_processor import make_core_request
from hpi_runtime.frontend.output_processor import OutputProcessor
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.outputs import RequestOutput, RequestOutputKind
from hpi_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineBusyError", "EngineDeadError", "EngineError", "EngineSleepingError"]

_NO_STATS = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)


class EngineDeadError(EngineError):
    """The engine core is not running (it died or was shut down); no request can make progress."""


class CoreClient(Protocol):
    async def start(self, on_message) -> CoreInfo: ...

    def send(self, message: AddRequest | AbortRequests | Sleep | WakeUp) -> None: ...

    async def shutdown(self) -> None: ...


class AsyncLLM:
    def __init__(self, client: CoreClient, tokenizer, config: EngineConfig) -> None:
        self.client = client
        self.config = config
        self.output_processor = OutputProcessor(tokenizer)
        self.core_info: CoreInfo | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats = _NO_STATS
        self._started = False
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._dead = asyncio.Event()
        # Sleep mode: one Sleep/WakeUp in flight at a time (the lock), answered through `_sleep_answer`.
        self._sleeping = False
        self._sleep_lock = asyncio.Lock()
        self._sleep_answer: asyncio.Future | None = None

    @classmethod
    def in_thread(cls, core: EngineCore, tokenizer) -> AsyncLLM:
        """The core loop in a thread of this process (tests inspect `client.core`)."""
        from hpi_runtime.core.core_process import ThreadCoreClient

        return cls(ThreadCoreClient(core), tokenizer, core.config)

    @property
    def errored(self) -> bool:
        """True once the core has died; the server should report itself unhealthy."""
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and self.dead_error is None

    async def start(self) -> CoreInfo:
        """Start the core (in a process: load the model there); ValueError if it cannot load with these settings,
        RuntimeError if it fails to load otherwise."""
        if not self._started:
            self.core_info = await self.client.start(self._on_core_message)
            self._started = True
        return self.core_info

    @property
    def is_sleeping(self) -> bool:
        """True from the moment a sleep is asked for until a wake-up has finished: no request is taken."""
        return self._sleeping

    async def sleep(self, level: int = 1) -> SleepAnswer:
        """Put the core to sleep (core/engine_core.py: EngineCore.sleep). New requests are refused from the
        moment it is asked (EngineSleepingError), so none slips in between the core's idleness check and its
        sleep. EngineBusyError if requests are in flight (the engine stays awake), ValueError for a bad level."""
        return _checked(await self._exchange(Sleep(level)))

    async def wake_up(self) -> SleepAnswer:
        """Restore the core's KV cache (and weights) and take requests again; a no-op when awake."""
        return _checked(await self._exchange(WakeUp()))

    async def _exchange(self, message: Sleep | WakeUp) -> SleepAnswer:
        # Shielded: a caller that goes away (its HTTP client disconnected) must not leave the core asleep while
        # this side believes it awake, nor let a second exchange start before the first one's answer.
        return await asyncio.shield(self._exchange_in_turn(message))

    async def _exchange_in_turn(self, message: Sleep | WakeUp) -> SleepAnswer:
        async with self._sleep_lock:
            if self.dead_error is not None or self._stopping or not self._started:
                raise EngineDeadError("the engine core is not running") from self.dead_error
            if isinstance(message, Sleep):
                self._sleeping = True
            self._sleep_answer = asyncio.get_running_loop().create_future()
            self.client.send(message)
            try:
                answer = await self._sleep_answer
            finally:
                self._sleep_answer = None
            self._sleeping = answer.is_sleeping  # the core's word, refusal or not
            return answer

    async def wait_dead(self) -> BaseException:
        """Return the cause once the core has died (never returns while it is healthy)."""
        await self._dead.wait()
        assert self.dead_error is not None
        return self.dead_error

    async def shutdown(self) -> None:
        self._stopping = True
        self._fail(list(self._queues), EngineDeadError("the engine was shut down"))
        if self._started:
            await self.client.shutdown()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (deltas; the last one, finished=True, also carries the whole output).

        Invalid input raises ValueError (QueueFullError when the queue is full) on the first iteration,
        before any output. A failed step raises EngineError. Close the generator when abandoning it
        (`contextlib.aclosing`, or `aclose()`) so the abort happens at once rather than when asyncio
        finalizes the garbage-collected generator; task cancellation aborts at once either way.
        A lower `priority` is admitted first among waiting requests. `lora_request`: the adapter to run it
        with (checked by the caller: lora/registry.py); None: the base model. `mm_inputs`: the prompt's images
        (multimodal/processor.py made them and the placeholders in the prompt).
        """
        if self.dead_error is not None or self._stopping or not self._started:
            raise EngineDeadError("the engine core is not running") from self.dead_error
        if self._sleeping:
            raise EngineSleepingError("the engine is asleep; wake it up (POST /wake_up) or retry on another replica")
        request = make_core_request(
            self.config, request_id, prompt_token_ids, sampling_params, time.monotonic(), priority, lora_request,
            mm_inputs,
        )
        queue: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(request, RequestOutputKind.DELTA)  # refuses an id in use
        self._queues[request_id] = queue
        self.client.send(AddRequest(request))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (break, cancel, disconnect)
                self.abort(request_id)

    def abort(self, request_id: str | Iterable[str]) -> None:
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in request_ids:
            self._queues.pop(rid, None)
        self.output_processor.abort_requests(request_ids)
        if self.dead_error is None and not self._stopping:
            self.client.send(AbortRequests(tuple(request_ids)))

    def get_stats(self) -> EngineStats:
        """The core's state as of its last message (it sends one after every step and every abort)."""
        return self._stats

    def _on_core_message(self, message: object) -> None:
        if isinstance(message, CoreOutputs):
            self._stats = message.stats
            processed = self.output_processor.process_outputs(message.outputs)
            for output in processed.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                    if output.finished:
                        del self._queues[output.request_id]
            if processed.request_ids_to_abort and self.dead_error is None:
                self.client.send(AbortRequests(tuple(processed.request_ids_to_abort)))
        elif isinstance(message, SleepAnswer):
            if self._sleep_answer is not None and not self._sleep_answer.done():
                self._sleep_answer.set_result(message)
        elif isinstance(message, RequestRejected):
            self.output_processor.abort_requests([message.request_id])
            error = QueueFullError(message.message) if message.queue_full else ValueError(message.message)
            if message.sleeping:
                error = EngineSleepingError(message.message)
            queue = self._queues.pop(message.request_id, None)
            if queue is not None:
                queue.put_nowait(error)
        elif isinstance(message, StepFailed):
            logger.error("engine step failed; failing requests %s", list(message.request_ids))
            self.output_processor.abort_requests(message.request_ids)
            self._fail(message.request_ids, EngineError(message.message, message.request_ids))
        elif isinstance(message, CoreDead):
            if self.dead_error is not None:
                return
            logger.error("the engine core died: %s; failing all requests", message.message)
            self.dead_error = RuntimeError(message.message)
            dead = EngineDeadError(f"engine core died: {message.message}")
            dead.__cause__ = self.dead_error
            self.output_processor.abort_requests(list(self._queues))
            self._fail(list(self._queues), dead)
            if self._sleep_answer is not None and not self._sleep_answer.done():
                self._sleep_answer.set_exception(dead)
            self._dead.set()

    def _fail(self, request_ids: Iterable[str], error: EngineError) -> None:
        """Deliver `error` to these requests' iterators, one exception object each."""
        for request_id in request_ids:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                per_request = type(error)(str(error), error.request_ids)
                per_request.__cause__ = error.__cause__
                queue.put_nowait(per_request)


def _checked(answer: SleepAnswer) -> SleepAnswer:
    """The answer, or its refusal as the exception the server maps to a status (409, 400, 500)."""
    if answer.error_kind == "busy":
        raise EngineBusyError(answer.error)
    if answer.error_kind == "invalid":
        raise ValueError(answer.error)
    if answer.error_kind is not None:
        raise RuntimeError(f"sleep mode failed in the engine core: {answer.error}")
    return answer
