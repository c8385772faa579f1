"""PipelineExecutor: the leader's end of a pipeline group, possibly spanning hosts (vLLM's multi-node layout).

The engine process is the world's rank 0 (the driver). It hosts the TCP store every rank and host meets at
(`--master-addr:--master-port`), spawns this host's model ranks (worker/pp_worker.py; the other hosts run
worker/pp_host.py, which spawns theirs), waits for the whole group and joins it. Each step is submitted
without waiting (`submit` returns a Future): its pickled SchedulerOutput goes to every rank, and a receiver
thread reads the last stage's samples back in order. The engine core keeps `max_concurrent_batches` (one per
stage, one more on CPU) in flight, so every stage has a batch to work on (core/engine_core.py's batch queue).

Failure ends the group, never a request alone: a local rank that exits, a rank or host that reports a failure in
the store, a worker host whose heartbeat stops for `heartbeat_timeout_s`, or a broken link makes the executor
dead: every batch in flight fails with ExecutorDeadError naming the cause, the failure callbacks fire (the
server turns /health and /ready false and exits 1, so LeaderWorkerSet recreates the group), the local ranks are
killed and the `abort` key tells the other hosts to stop theirs. Start-up waits `timeout_s` for every rank to
join and names the ranks (and hosts) that did not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from hpi_contracts.pipeline_split import split_disagreement
from hpi_runtime.core.interface import (
    KILLED_BY_SIGNAL,
    ExecutorDeadError,
    ModelRunnerOutput,
    SchedulerOutput,
    describe_exit,
)
from hpi_runtime.worker.executor import ExecutorConfig
from hpi_runtime.worker.pp_layout import GroupLayout, resolve_layout
from hpi_runtime.worker.pp_link import SHUTDOWN, STEP_TIMEOUT, recv_message, send_message
from hpi_runtime.worker.pp_worker import (
    ABORT_KEY,
    FAILURES_KEY,
    GROUP_COMPLETE_KEY,
    STATS_INTERVAL_S,
    RankSpec,
    connect_store,
    init_world,
    run_rank,
)

logger = logging.getLogger(__name__)

POLL_S = 0.25
STOP_TIMEOUT_S = 10.0
# How long a rank's own report waits for its host's: the host's watcher wakes as soon as a rank exits, and a rank
# that reported a failure exits right after, so the host's word (which says whether a sibling was killed first)
# follows within the time a process takes to exit.
HOST_REPORT_GRACE_S = 2.0


def heartbeat_key(node: int) -> str:
    return f"heartbeat/{node}"


class PipelineExecutor:
    max_concurrent_batches: int

    def __init__(self, config: ExecutorConfig, layout: GroupLayout | None = None) -> None:
        layout = layout or resolve_layout(config.parallel, os.environ)
        if not layout.is_leader:
            raise ValueError(f"the executor runs on the leader (node_rank 0), not node_rank {layout.node_rank}")
        if config.device.type == "cuda" and torch.cuda.device_count() < layout.ranks_per_node:
            raise ValueError(f"{layout.ranks_per_node} ranks per host need as many CUDA devices; "
                             f"{torch.cuda.device_count()} are visible")  # fmt: skip
        self.config, self.layout = config, layout
        # One batch per stage, and on CPU one more: the leader's driver (samples back, the next step scheduled and
        # pickled) shares the first stage's cores, and the extra batch keeps that stage busy across the hand-off
        # (bench/results/multi_node.md, 32 clients: stage 0 busy 73-82% -> 87-91% over three splits, side by side).
        # GPUs keep vLLM's one per stage (smaller batches cost a GPU more; unmeasured there).
        extra = 1 if config.device.type == "cpu" else 0
        self.max_concurrent_batches = layout.pipeline_parallel_size + extra
        self._lock = threading.Lock()
        self._dead: ExecutorDeadError | None = None
        self._closing = False
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._pending: queue.Queue[Future | None] = queue.Queue()  # submitted, in order, awaiting samples
        self._futures: list[Future] = []  # not yet resolved (failed together on death)
        self._sends: list = []  # step messages on the wire
        self._busy_s: tuple[float, ...] = ()  # stage_busy_s's last reading, and when
        self._busy_read_at = -STATS_INTERVAL_S
        self._answering_rank = 1 + layout.stage_model_ranks(layout.pipeline_parallel_size - 1)[0]
        self._store = connect_store(layout, is_master=True)
        context = multiprocessing.get_context("spawn")
        threads = max(1, len(os.sched_getaffinity(0)) // layout.ranks_per_node)  # the cores this host may use
        self._ranks: dict[int, multiprocessing.process.BaseProcess] = {}
        for m in layout.node_model_ranks(0):
            process = context.Process(target=run_rank, args=(RankSpec(m, layout, config, threads),),
                                      name=f"hpi-pp-rank{m}", daemon=True)  # fmt: skip
            process.start()
            self._ranks[m] = process
        try:
            self._wait_for_group()
        except BaseException:
            self._closing = True
            self._abort("the leader failed to start")
            if dist.is_initialized():  # a later engine in this process may start a group of its own
                dist.destroy_process_group()
            raise
        self._last_beats = {n: (self._beat(n), time.monotonic()) for n in range(1, layout.nnodes)}
        threading.Thread(target=self._receive, name="hpi-pp-receiver", daemon=True).start()
        threading.Thread(target=self._watch, name="hpi-pp-monitor", daemon=True).start()

    # -- start-up --------------------------------------------------------------------------------------------

    def _wait_for_group(self) -> None:
        layout = self.layout
        all_ranks = range(layout.num_model_ranks)
        while not self._store.check([f"joined/{m}" for m in self._ranks]):  # this host's: bounded by their health
            self._raise_on_failure()
            time.sleep(POLL_S)
        deadline = time.monotonic() + layout.timeout_s  # the other hosts' ranks
        while not self._store.check([f"joined/{m}" for m in all_ranks]):
            self._raise_on_failure()
            if time.monotonic() > deadline:
                missing = [m for m in all_ranks if not self._store.check([f"joined/{m}"])]
                hosts = sorted({layout.node_of(m) for m in missing})
                raise RuntimeError(
                    f"pipeline group incomplete after {layout.timeout_s:.0f} s: ranks {missing} (on hosts "
                    f"{hosts}, node_rank) did not join the leader at {layout.master_addr}:{layout.master_port}; "
                    "is every host of the group running `hpi serve` with the same flags?"
                )
            time.sleep(POLL_S)
        self._store.set(GROUP_COMPLETE_KEY, "1")
        backend = "nccl" if self.config.device.type == "cuda" else "gloo"
        init_world(layout, self._store, 0, backend)
        while not self._store.check([f"ready/{m}" for m in all_ranks]):  # loading: bounded by the ranks' health
            self._raise_on_failure()
            time.sleep(POLL_S)
        spans = [tuple(int(v) for v in self._store.get(f"layers/{layout.stage_model_ranks(s)[0]}").split(b","))
                 for s in range(layout.pipeline_parallel_size)]  # fmt: skip
        problem = split_disagreement(spans, self.config.model_config.num_layers)
        if problem is not None:
            raise RuntimeError(problem)
        infos = [pickle.loads(self._store.get(f"ready/{m}")) for m in all_ranks]
        footprints = [footprint for footprint, _ in infos]
        self.footprint = dataclasses.replace(
            footprints[0],  # block counts: every rank holds the same
            weight_bytes=sum(f.weight_bytes for f in footprints),
            kv_cache_bytes=sum(f.kv_cache_bytes for f in footprints),
            host_kv_cache_bytes=sum(f.host_kv_cache_bytes for f in footprints),
        )
        self.startup = {phase: max(phases.get(phase, 0.0) for _, phases in infos)
                        for phase in dict.fromkeys(p for _, phases in infos for p in phases)}  # fmt: skip
        logger.info("pipeline parallel: %d stages x %d tensor-parallel ranks on %d hosts ready (%s)",
                    layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.nnodes, backend)  # fmt: skip

    def _raise_on_failure(self) -> None:
        reason = self._failure()
        if reason is not None:
            raise RuntimeError(reason)

    def _failure(self) -> str | None:
        """Why the group cannot go on, or None: a local rank that exited, a failure reported in the store."""
        for m, process in self._ranks.items():
            if not process.is_alive():
                how = describe_exit(process.exitcode)
                return self._reported_failures() or f"pipeline rank {m} (pid {process.pid}, on the leader) {how}"
        return self._reported_failures()

    def _reported_failures(self) -> str | None:
        try:
            if not self._store.add(FAILURES_KEY, 0):
                return None
            whos = [str(m) for m in range(self.layout.num_model_ranks)] + [
                f"host{n}" for n in range(1, self.layout.nnodes)]  # fmt: skip
            messages = [self._store.get(f"failed/{w}").decode() for w in whos if self._store.check([f"failed/{w}"])]
        except Exception as exc:  # the store lives in this process: this is not expected
            return f"the leader's store failed: {exc}"
        messages.sort(key=lambda message: KILLED_BY_SIGNAL not in message)  # the cause before what it caused
        return "; ".join(messages) or None

    def _beat(self, node: int) -> int:
        return self._store.add(heartbeat_key(node), 0)

    # -- steps -----------------------------------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.footprint.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def num_host_kv_blocks(self) -> int:
        return self.footprint.num_host_kv_blocks

    def submit(self, scheduler_output: SchedulerOutput) -> Future:
        """Send the step to every rank; the Future resolves to the last stage's ModelRunnerOutput."""
        if self._dead is not None:
            raise self._dead
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        future: Future = Future()
        with self._lock:
            self._futures.append(future)
        try:
            self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[0])]
            for m in range(self.layout.num_model_ranks):
                self._sends.append(send_message(payload, m + 1))
        except Exception as exc:
            raise self._die(self._explain(f"sending a step failed: {exc}")) from None
        self._pending.put(future)
        return future

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(scheduler_output).result()

    def _receive(self) -> None:
        """The last stage's samples, one message per step, in submission order."""
        while True:
            future = self._pending.get()
            if future is None:
                return
            try:
                _, payload = recv_message(self._answering_rank, STEP_TIMEOUT * self.max_concurrent_batches)
                output = pickle.loads(payload)
            except Exception as exc:
                if not self._closing:
                    self._die(self._explain(f"the link to the last pipeline stage broke: {exc}"))
                return
            with self._lock:
                if future in self._futures:
                    self._futures.remove(future)
            if not future.done():
                future.set_result(output)

    def _explain(self, symptom: str) -> str:
        """A broken link is a symptom: give the monitor's cause (a rank's own report) a moment to arrive."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            reason = self._failure()
            if reason is not None:
                return self._settled(reason)
            time.sleep(POLL_S)
        return symptom

    def _watch(self) -> None:
        """Local ranks' exits, failures reported in the store, worker hosts' heartbeats."""
        sentinels = [p.sentinel for p in self._ranks.values()]
        while not self._closing and self._dead is None:
            wait(sentinels, POLL_S)
            if self._closing:
                return
            reason = self._failure() or self._silent_host()
            if reason is not None:
                self._die(self._settled(reason))
                return

    def _settled(self, reason: str) -> str:
        """A rank's own report may be a symptom: when a rank is killed, its peers see their connections to it
        reset and report that, and the killed rank's host reports the kill a moment later. Wait (at most
        HOST_REPORT_GRACE_S) until every worker host with a failed rank has reported too and, when a rank on the
        leader's host failed, until some worker host has (a broken link to any of them looks the same), then give
        the reasons with the kills first."""
        deadline = time.monotonic() + HOST_REPORT_GRACE_S
        while not self._hosts_reported() and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        return self._failure() or reason

    def _hosts_reported(self) -> bool:
        try:
            failed = [m for m in range(self.layout.num_model_ranks) if self._store.check([f"failed/{m}"])]
            hosts = {self.layout.node_of(m) for m in failed}
            reported = {n for n in range(1, self.layout.nnodes) if self._store.check([f"failed/host{n}"])}
            return hosts - {0} <= reported and (0 not in hosts or self.layout.nnodes == 1 or bool(reported))
        except Exception:  # the store lives in this process: nothing to wait for if it fails
            return True

    def _silent_host(self) -> str | None:
        now = time.monotonic()
        for node, (count, seen_at) in self._last_beats.items():
            beat = self._beat(node)
            if beat != count:
                self._last_beats[node] = (beat, now)
            elif now - seen_at > self.layout.heartbeat_timeout_s:
                ranks = list(self.layout.node_model_ranks(node))
                return (f"pipeline host {node} (ranks {ranks}) sent no heartbeat for "
                        f"{self.layout.heartbeat_timeout_s:.0f} s: it hangs or is unreachable")  # fmt: skip
        return None

    def _die(self, reason: str) -> ExecutorDeadError:
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = ExecutorDeadError(reason)
            dead, futures, self._futures = self._dead, self._futures, []
        if first:
            logger.error("%s; stopping the pipeline group", reason)
            for future in futures:
                if not future.done():
                    future.set_exception(dead)
            self._abort(reason)
            if not self._closing:
                for callback in self._callbacks:
                    callback(dead)
        return dead

    def _abort(self, reason: str) -> None:
        """Kill this host's ranks and tell the other hosts to stop theirs."""
        try:
            self._store.set(ABORT_KEY, reason)
        except Exception:
            pass
        for process in self._ranks.values():
            if process.is_alive():
                process.kill()
        for process in self._ranks.values():
            process.join(STOP_TIMEOUT_S)

    # -- stats, sleep, shutdown ------------------------------------------------------------------------------

    def stage_stats(self) -> dict[int, dict]:
        """Per model rank: its latest published busy and wall seconds and link bytes (worker/pp_worker.py)."""
        stats = {}
        for m in range(self.layout.num_model_ranks):
            if self._store.check([f"stats/{m}"]):
                stats[m] = json.loads(self._store.get(f"stats/{m}"))
        return stats

    def stage_busy_s(self) -> tuple[float, ...]:
        """Each stage's busy seconds as its first tensor-parallel rank last published them; read from the store at
        most once per STATS_INTERVAL_S (the engine asks every step)."""
        now = time.monotonic()
        if now - self._busy_read_at >= STATS_INTERVAL_S:
            stats = self.stage_stats()
            first_ranks = [self.layout.stage_model_ranks(s)[0] for s in range(self.layout.pipeline_parallel_size)]
            self._busy_s = tuple(stats.get(m, {}).get("busy_s", 0.0) for m in first_ranks)
            self._busy_read_at = now
        return self._busy_s

    def sleep(self, level: int) -> int:
        raise ValueError("sleep mode is not available with pipeline parallelism")

    def wake_up(self) -> int:
        raise ValueError("sleep mode is not available with pipeline parallelism")

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._callbacks.append(callback)
        if self._dead is not None and not self._closing:
            callback(self._dead)

    def shutdown(self) -> None:
        """Stop every rank: each finishes the steps it has, then exits (the other hosts' processes with them)."""
        if self._closing:
            return
        self._closing = True
        if self._dead is None:
            try:
                for m in range(self.layout.num_model_ranks):
                    self._sends.append(send_message(b"", m + 1, SHUTDOWN))
                for works, *_ in self._sends:
                    for work in works:
                        work.wait(STEP_TIMEOUT)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                stopped = [f"stopped/{m}" for m in range(self.layout.num_model_ranks)]
                while not self._store.check(stopped) and time.monotonic() < deadline:
                    time.sleep(POLL_S / 5)
            except Exception as exc:
                logger.warning("stopping the pipeline group: %s", exc)
        self._pending.put(None)
        with self._lock:
            for process in self._ranks.values():
                process.join(STOP_TIMEOUT_S)
        self._abort("the leader shut down")
        if dist.is_initialized():
            dist.destroy_process_group()
