"""AsyncLLM: the asyncio front of LLMEngine. One background thread runs step(); outputs stream per request.

The thread sleeps on an event while there is no work. Each step's outputs cross to the event loop in one
`call_soon_threadsafe` and land in per-request asyncio queues. A consumer that stops iterating (or whose
task is cancelled) aborts its request, which frees its KV blocks at once. A failed step fails only its
own requests (their iterators raise `EngineError`); anything else that escapes the loop kills it, and so
does an executor that reports its own death between steps (a tensor-parallel worker gone): every request
then raises `EngineDeadError`, `errored` turns true and `wait_dead()` returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterable

from hpi_runtime.core.engine import EngineError, EngineStats, LLMEngine
from hpi_runtime.outputs import RequestOutput
from hpi_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineError"]


class EngineDeadError(EngineError):
    """The engine loop is not running (it crashed or was shut down); no request can make progress."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Event()
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._executor_failure: BaseException | None = None  # set from any thread by the executor
        self._dead = asyncio.Event()

    @property
    def errored(self) -> bool:
        """True once the background loop has died; the server should report itself unhealthy."""
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.engine.executor.register_failure_callback(self._on_executor_failure)
        self._thread = threading.Thread(target=self._run, name="hpi-engine-loop", daemon=True)
        self._thread.start()

    async def wait_dead(self) -> BaseException:
        """Return the cause once the engine loop has died (never returns while it is healthy)."""
        await self._dead.wait()
        assert self.dead_error is not None
        return self.dead_error

    def _on_executor_failure(self, error: BaseException) -> None:
        self._executor_failure = error
        self._wakeup.set()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail(list(self._queues), EngineDeadError("the engine was shut down"))
        await asyncio.to_thread(self.engine.shutdown)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has finished=True.

        Invalid input raises ValueError (QueueFullError when the queue is full) on the first iteration,
        before any output. A failed step raises EngineError. Close the generator when abandoning it
        (`contextlib.aclosing`, or `aclose()`) so the abort happens at once rather than when asyncio
        finalizes the garbage-collected generator; task cancellation aborts at once either way.
        A lower `priority` is admitted first among waiting requests.
        """
        if self.dead_error is not None or self._stopping or self._thread is None:
            raise EngineDeadError("the engine loop is not running") from self.dead_error
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self.engine.add_request(request_id, prompt_token_ids, sampling_params, priority=priority)
        self._queues[request_id] = queue
        self._wakeup.set()
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
        self.engine.abort_request(request_ids)
        self._wakeup.set()  # let the loop flush the abort outputs

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wakeup.clear()
            if self._executor_failure is not None:
                self._die(self._executor_failure)
                return
            if not engine.has_unfinished_requests():
                self._wakeup.wait()
                continue
            try:
                outputs = engine.step()
            except EngineError as exc:
                logger.exception("engine step failed; failing requests %s", sorted(exc.request_ids))
                self._call_in_loop(self._fail, exc.request_ids, exc)
                continue
            except BaseException as exc:
                logger.exception("engine loop died; failing all requests")
                self._die(exc)
                return
            if outputs:
                self._call_in_loop(self._deliver, outputs)

    def _die(self, cause: BaseException) -> None:
        self.dead_error = cause
        dead = EngineDeadError(f"engine loop died: {cause}")
        dead.__cause__ = cause
        self._call_in_loop(self._fail, None, dead)
        self._call_in_loop(self._dead.set)

    def _call_in_loop(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:
                    del self._queues[output.request_id]

    def _fail(self, request_ids: Iterable[str] | None, error: EngineError) -> None:
        """Deliver `error` to these requests' iterators (None: to all), one exception object each."""
        for request_id in list(self._queues) if request_ids is None else request_ids:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                per_request = type(error)(str(error), error.request_ids)
                per_request.__cause__ = error.__cause__
                queue.put_nowait(per_request)
