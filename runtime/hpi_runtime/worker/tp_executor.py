"""MultiprocExecutor: one worker process per tensor-parallel rank, driven by the engine's single scheduler.

The engine process schedules once per step and sends the same pickled `SchedulerOutput` to every rank
(each keeps its own copy of the request states and its share of the paged KV cache); the ranks run the
forward together (gloo on CPU, NCCL on GPUs) and rank 0, which samples, answers with the
`ModelRunnerOutput`. Every rank acknowledges every step, so a failure anywhere is seen at once.

A worker that dies (killed, out of memory, a crash in a collective) ends the executor: the others are
stopped, the step in flight raises `ExecutorDeadError`, and a monitor thread reports a death between
steps through the failure callbacks, so an idle server notices too.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from hpi_runtime.core.interface import ExecutorDeadError, ModelRunnerOutput, SchedulerOutput, describe_exit
from hpi_runtime.worker.executor import ExecutorConfig
from hpi_runtime.worker.tp_worker import OK, READY, SHUTDOWN, SLEEP_PREFIX, WAKE_UP, WorkerSpec, run_worker

logger = logging.getLogger(__name__)

# Once one rank has reported a failed step, how long the others may take to report theirs before they
# are presumed stuck in a collective the failed rank never joined.
STRAGGLER_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
EXIT_REAP_TIMEOUT_S = 2.0


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection

    def describe_exit(self, reap_lock: threading.Lock) -> str:
        # Its pipe closes a moment before it can be reaped; one thread reaps at a time (two concurrent
        # waitpid calls leave the loser without an exit code).
        with reap_lock:
            self.process.join(EXIT_REAP_TIMEOUT_S)
        code = self.process.exitcode
        if code is None:
            return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid}) closed its pipe"
        return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid}) {describe_exit(code)}"


class MultiprocExecutor:
    def __init__(self, config: ExecutorConfig) -> None:
        size = config.parallel.tensor_parallel_size
        if size < 2:
            raise ValueError(f"MultiprocExecutor needs tensor_parallel_size >= 2, got {size}")
        if config.device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices; "
                             f"{torch.cuda.device_count()} are visible")  # fmt: skip
        self.config = config
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._closing = False
        self._dead: ExecutorDeadError | None = None
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._store_dir = tempfile.mkdtemp(prefix="hpi-tp-")
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        threads = max(1, (os.cpu_count() or 1) // size)
        self._workers: list[_Worker] = []
        for rank in range(size):
            parent_conn, child_conn = context.Pipe()
            spec = WorkerSpec(rank, config, f"file://{self._store_dir}/store", threads)
            process = context.Process(target=run_worker, args=(spec, child_conn), name=f"hpi-tp-rank{rank}",
                                      daemon=True)  # fmt: skip
            process.start()
            child_conn.close()
            self._workers.append(_Worker(rank, process, parent_conn))
        try:
            # A rank that fails may leave the others waiting for it in a collective: stop at the first failure.
            replies, failures = self._gather_replies(READY, stop_at_failure=True)
            if failures:  # the first rank's own exception (a ValueError for a budget that is too small, ...)
                raise failures[0]
            infos = [footprint for footprint, _ in replies]
        except BaseException:
            self.shutdown()
            raise
        self.footprint = dataclasses.replace(
            infos[0],  # block counts: every rank holds the same
            weight_bytes=sum(info.weight_bytes for info in infos),
            kv_cache_bytes=sum(info.kv_cache_bytes for info in infos),
            host_kv_cache_bytes=sum(info.host_kv_cache_bytes for info in infos),
        )
        # Each start-up phase as long as its slowest rank took (the ranks start side by side; the last one gates).
        self.startup = {phase: max(phases.get(phase, 0.0) for _, phases in replies)
                        for phase in dict.fromkeys(p for _, phases in replies for p in phases)}  # fmt: skip
        self._monitor = threading.Thread(target=self._watch, name="hpi-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info("tensor parallel: %d worker processes ready (%s), pids %s", size,
                    "NCCL" if config.device.type == "cuda" else "gloo", self.worker_pids)  # fmt: skip

    @property
    def num_kv_blocks(self) -> int:
        return self.footprint.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def num_host_kv_blocks(self) -> int:
        return self.footprint.num_host_kv_blocks

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise self._dead
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError:  # its end of the pipe is closed: it is dead or dying
                raise self._die(worker.describe_exit(self._reap_lock)) from None
        outputs, failures = self._gather_replies(OK)
        if failures:  # every rank answered: the step failed, the workers live on
            raise RuntimeError("; ".join(map(str, failures)))
        return outputs[0]

    def _gather_replies(self, expected: str, stop_at_failure: bool = False) -> tuple[list, list[BaseException]]:
        """(one reply per rank in rank order, the failures ranks reported). A worker that dies, or stays
        silent for STRAGGLER_TIMEOUT_S after another reported a failure, raises ExecutorDeadError (and
        stops every worker)."""
        replies: dict[int, object] = {}
        failures: list[BaseException] = []
        pending = {w.conn: w for w in self._workers}
        sentinels = {w.process.sentinel: w for w in self._workers}
        while pending:
            timeout = STRAGGLER_TIMEOUT_S if failures else None
            ready = wait([*pending, *(s for s, w in sentinels.items() if w.conn in pending)], timeout)
            if not ready:
                silent = sorted(w.rank for w in pending.values())
                raise self._die(f"{'; '.join(map(str, failures))}; ranks {silent} did not answer within "
                                f"{STRAGGLER_TIMEOUT_S:.0f} s (stuck in a collective)")  # fmt: skip
            for conn in [r for r in ready if r in pending]:  # messages before deaths: a failing rank says why
                worker = pending.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._die(worker.describe_exit(self._reap_lock)) from None
                if status == expected:
                    replies[worker.rank] = value
                else:
                    failures.append(value)
            if failures and stop_at_failure:
                break
            for sentinel in [r for r in ready if r in sentinels]:
                worker = sentinels[sentinel]
                if worker.conn in pending:
                    after = f" after: {'; '.join(map(str, failures))}" if failures else ""
                    raise self._die(worker.describe_exit(self._reap_lock) + after)
        return [replies.get(w.rank) for w in self._workers], failures

    def _die(self, reason: str) -> ExecutorDeadError:
        """Record the executor's death, stop every worker and tell the callbacks (once)."""
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = ExecutorDeadError(reason)
            dead = self._dead
        if first:
            logger.error("%s; stopping all tensor-parallel workers", reason)
            self._stop_workers(graceful=False)
            if not self._closing:
                for callback in self._callbacks:
                    callback(dead)
        return dead

    def _watch(self) -> None:
        """Between steps nobody waits on the workers: this thread notices one dying."""
        sentinels = {w.process.sentinel: w for w in self._workers}
        ready = wait(list(sentinels))
        if not self._closing:
            self._die(sentinels[ready[0]].describe_exit(self._reap_lock))

    def sleep(self, level: int) -> int:
        """Every rank releases its shard (the core sends this between steps, so no rank is in a collective);
        the bytes freed over all ranks."""
        return self._command(SLEEP_PREFIX + str(level).encode())

    def wake_up(self) -> int:
        """Every rank restores its shard; the bytes restored over all ranks."""
        return self._command(WAKE_UP)

    def _command(self, message: bytes) -> int:
        if self._dead is not None:
            raise self._dead
        for worker in self._workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                raise self._die(worker.describe_exit(self._reap_lock)) from None
        replies, failures = self._gather_replies(OK)
        if failures:
            raise RuntimeError("; ".join(map(str, failures)))
        return sum(replies)

    def stage_busy_s(self) -> tuple[float, ...]:
        return ()  # one pipeline stage

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._callbacks.append(callback)
        if self._dead is not None and not self._closing:
            callback(self._dead)

    def shutdown(self) -> None:
        self._closing = True
        self._stop_workers(graceful=self._dead is None)
        for worker in self._workers:
            worker.conn.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            for worker in self._workers:
                try:
                    worker.conn.send_bytes(SHUTDOWN)
                except OSError:
                    pass
        with self._reap_lock:
            if graceful:
                for worker in self._workers:
                    worker.process.join(STOP_TIMEOUT_S)
            for worker in self._workers:
                if worker.process.is_alive():
                    worker.process.kill()
            for worker in self._workers:
                worker.process.join(STOP_TIMEOUT_S)
