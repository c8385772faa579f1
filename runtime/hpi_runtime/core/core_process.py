"""The engine core's loop, run in its own process under the server (or in a thread, for tests).

One loop drives an `EngineCore`: apply every message the frontend sent (add, abort, sleep, wake, shutdown),
run one step, emit its deltas and a stats snapshot (and, before a step that prefills, one more: such a step can run
for seconds). In its own process the core holds the GIL alone, so the model step never waits on the API server's
event loop, and the event loop never waits on a step.

- `ProcessCoreClient` spawns the core process (which loads the model itself), waits for its `CoreInfo`,
  then sends messages over a pipe and receives the core's through an event-loop reader: no thread in the
  frontend. A reader thread in the core process drains the pipe while a step runs, so the frontend's writes
  never wait for a step. Messages are pickled (protocol 5, what multiprocessing.Connection uses): a step's
  deltas for 64 requests encode in tens of microseconds (bench/results/engine_process.md).
- `ThreadCoreClient` runs the same loop in a thread of this process over a core the caller built (tests with
  fake executors inspect its scheduler and block pool).

A core that dies (its process killed, its executor gone, a bug in the loop) is reported to the frontend as
`CoreDead`: every request then fails and the server reports itself unhealthy. The core process ignores
SIGINT and SIGTERM: the server decides when it stops (it drains first), and a Ctrl-C in a terminal reaches
the whole process group. If the server process disappears, the core sees its pipe close and exits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.engine_core import EngineBusyError, EngineCore, EngineError, EngineSleepingError, QueueFullError
from hpi_runtime.core.engine_io import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreInfo,
    CoreOutputs,
    RequestRejected,
    Shutdown,
    Sleep,
    SleepAnswer,
    StepFailed,
    WakeUp,
)
from hpi_runtime.core.interface import ExecutorDeadError, MemoryFootprint

if TYPE_CHECKING:
    from hpi_runtime.worker.executor import ExecutorConfig

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.5
STOP_TIMEOUT_S = 30.0

Emit = Callable[[object], None]


@dataclass(frozen=True)
class _ExecutorFailed:
    """Put in the inbox by the executor's failure callback (a tensor-parallel worker died between steps)."""

    error: BaseException


def run_core_loop(core: EngineCore, inbox: queue.Queue, emit: Emit) -> None:
    """Until a Shutdown message: apply inputs, step, emit. Emits CoreDead (and returns) if the core dies."""
    core.executor.register_failure_callback(lambda error: inbox.put(_ExecutorFailed(error)))
    core.on_prefill_scheduled = lambda: emit(CoreOutputs((), core.get_stats()))  # the stats while it runs
    try:
        while True:
            # Block for input only when there is nothing to step.
            messages = [] if core.has_unfinished_requests() else [inbox.get()]
            while True:
                try:
                    messages.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for message in messages:
                if isinstance(message, Shutdown):
                    return
                _apply(core, message, emit)
            try:
                outputs = core.step()
            except EngineError as exc:
                logger.error("engine step failed: %s", exc)
                emit(StepFailed(tuple(sorted(exc.request_ids)), str(exc)))
                continue
            if outputs or messages:
                emit(CoreOutputs(tuple(outputs), core.get_stats()))
    except BaseException as exc:
        logger.exception("the engine core died")
        emit(CoreDead(f"{type(exc).__name__}: {exc}"))


def _apply(core: EngineCore, message: object, emit: Emit) -> None:
    if isinstance(message, AddRequest):
        try:
            core.add_request(message.request)
        except ValueError as exc:  # the frontend checked what it could; the queues are only known here
            emit(RequestRejected(message.request.request_id, str(exc), isinstance(exc, QueueFullError)))
        except EngineSleepingError as exc:
            emit(RequestRejected(message.request.request_id, str(exc), False, sleeping=True))
    elif isinstance(message, (Sleep, WakeUp)):
        emit(_sleep_or_wake(core, message))
    elif isinstance(message, AbortRequests):
        core.abort_requests(message.request_ids)
    elif isinstance(message, _ExecutorFailed):
        raise ExecutorDeadError(str(message.error)) from message.error
    else:
        raise TypeError(f"unknown message {message!r}")


def _sleep_or_wake(core: EngineCore, message: Sleep | WakeUp) -> SleepAnswer:
    """Run it between steps (the loop is idle: sleep refuses otherwise) and say how it went. A failure
    answers the request and leaves the core running: asleep still if waking failed, so it can be retried."""
    start = time.perf_counter()
    try:
        num_bytes = core.sleep(message.level) if isinstance(message, Sleep) else core.wake_up()
    except Exception as exc:
        kind = "busy" if isinstance(exc, EngineBusyError) else "invalid" if isinstance(exc, ValueError) else "failed"
        if kind == "failed":
            logger.exception("%s failed", type(message).__name__)
        return SleepAnswer(bool(core.sleep_level), core.sleep_level, error=str(exc), error_kind=kind)
    # A call that changed nothing (asleep already, awake already) took no time to speak of: 0, not the microseconds
    # between the two clock reads, which a loaded machine stretches past the answer's rounding.
    seconds = time.perf_counter() - start if num_bytes else 0.0
    if num_bytes:
        logger.info("%s: %.1f MiB %s in %.2f s", "asleep" if core.sleep_level else "awake", num_bytes / 2**20,
                    "freed" if core.sleep_level else "restored", seconds)
    return SleepAnswer(bool(core.sleep_level), core.sleep_level, num_bytes, seconds)


class ThreadCoreClient:
    """The core loop in a thread of this process, over a core the caller built."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    async def start(self, on_message: Emit) -> CoreInfo:
        loop = asyncio.get_running_loop()

        def emit(message: object) -> None:
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        self._thread = threading.Thread(
            target=run_core_loop, args=(self.core, self._inbox, emit), name="hpi-engine-core", daemon=True
        )
        self._thread.start()
        manager = self.core.kv_cache_manager  # a core built by the caller: its executor's bytes are not known here
        return CoreInfo(MemoryFootprint(0, 0, manager.num_blocks, self.core.config.block_size))

    def send(self, message: AddRequest | AbortRequests | Sleep | WakeUp) -> None:
        self._inbox.put(message)

    async def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.core.shutdown)


@dataclass(frozen=True)
class CoreProcessSpec:
    """Everything the core process needs to build its core (pickled into the child)."""

    engine_config: EngineConfig
    executor_config: ExecutorConfig
    eos_token_ids: frozenset[int]
    log_level: int = logging.INFO


def _core_process_main(spec: CoreProcessSpec, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    from hpi_runtime.worker.factory import make_executor

    try:
        executor = make_executor(spec.executor_config)
        core = EngineCore(spec.engine_config, executor, spec.eos_token_ids,
                          grammar_compiler=_grammar_compiler(spec))
    except BaseException as exc:
        if isinstance(exc, ValueError):  # a setting: the server logs the message; the stack at debug level only
            logger.debug("loading the model in the engine core failed", exc_info=True)
            conn.send(CoreDead(str(exc), settings=True))
            return
        logger.exception("loading the model in the engine core failed")
        conn.send(CoreDead(f"loading failed: {type(exc).__name__}: {exc}"))
        return
    conn.send(CoreInfo(executor.footprint, tuple(executor.startup.items())))
    # The model and everything loaded so far live as long as the process: keep them out of the GC's way.
    gc.collect()
    gc.freeze()
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server is gone: stop
                inbox.put(Shutdown())
                return
            inbox.put(message)
            if isinstance(message, Shutdown):
                return

    threading.Thread(target=read, name="hpi-core-reader", daemon=True).start()
    run_core_loop(core, inbox, conn.send)
    core.shutdown()


def _grammar_compiler(spec: CoreProcessSpec):
    """Structured outputs in the core: the tokenizer is read from the model directory when first needed."""
    from hpi_runtime.structured.compiler import GrammarCompiler

    model_config = spec.executor_config.model_config

    def load_tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_config.model_dir)

    return GrammarCompiler(load_tokenizer, model_config.vocab_size, spec.eos_token_ids)


def exit_text(code: int) -> str:
    """How a process ended, for a log line: SIGKILL says what most often sends it to a loading engine."""
    if code == -signal.SIGKILL:
        return ("was killed (SIGKILL: most often the kernel's out-of-memory killer, when the weights and the KV "
                "cache do not fit the memory this process may use)")  # fmt: skip
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal has no name
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessCoreClient:
    """Runs the engine core in a spawned process; talks to it over a pipe read by the event loop."""

    def __init__(self, spec: CoreProcessSpec) -> None:
        self.spec = spec
        self._conn = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._on_message: Emit | None = None

    async def start(self, on_message: Emit) -> CoreInfo:
        """Spawn the core and wait until its model is loaded. ValueError if it cannot load with these settings,
        RuntimeError if it fails to load otherwise."""
        context = multiprocessing.get_context("spawn")  # never fork a process that holds threads
        self._conn, child_conn = context.Pipe()
        # Not a daemon: the core spawns tensor-parallel workers of its own.
        self._process = context.Process(target=_core_process_main, args=(self.spec, child_conn), name="hpi-core")
        self._process.start()
        child_conn.close()
        first = await asyncio.to_thread(self._wait_first_message)
        if not isinstance(first, CoreInfo):
            await self.shutdown()
            if isinstance(first, CoreDead) and first.settings:
                raise ValueError(first.message)
            raise RuntimeError(first.message if isinstance(first, CoreDead) else f"unexpected {first!r}")
        self._on_message = on_message
        asyncio.get_running_loop().add_reader(self._conn.fileno(), self._on_readable)
        return first

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _wait_first_message(self) -> object:
        while not self._conn.poll(STARTUP_POLL_S):
            if not self._process.is_alive():
                return CoreDead(f"the engine core process {exit_text(self._process.exitcode)} while loading")
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(STOP_TIMEOUT_S)
            return CoreDead(f"the engine core process {exit_text(self._process.exitcode)} while loading")

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._on_message(self._conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._process.join(1.0)
            code = self._process.exitcode
            how = "is still running" if code is None else exit_text(code)
            self._on_message(CoreDead(f"the engine core process closed its pipe and {how}"))

    def send(self, message: AddRequest | AbortRequests | Sleep | WakeUp) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):  # the core is gone; _on_readable reports it
            pass

    async def shutdown(self) -> None:
        if self._process is None:
            return
        if self._on_message is not None and self._conn is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._conn.fileno())
            except (ValueError, OSError):
                pass
        try:
            self._conn.send(Shutdown())
        except (BrokenPipeError, OSError):
            pass
        await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self._process.kill()
            await asyncio.to_thread(self._process.join)
        self._conn.close()
        self._process = None

