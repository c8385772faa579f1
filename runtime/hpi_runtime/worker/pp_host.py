"""A worker host of a pipeline group (`hpi serve --node-rank R`, R > 0): spawn this host's model ranks, answer
`GET /health` for the pod's probes, beat a heartbeat into the leader's store, and end with the group.

It serves nothing else: requests go to the leader. `/health` is 200 while every local rank is alive and has
joined and loaded (its `ready/<m>` key is set), 503 before and after. The process exits:
- 0 when its ranks stop because the leader shut the group down (or on SIGTERM, after stopping them);
- 1 when a local rank dies (reported to the leader as `failed/host<R>` first), when the leader says `abort`,
  or when the leader's store stops answering (the leader is gone): LeaderWorkerSet then recreates the group.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import wait

from hpi_runtime.core.interface import describe_exit
from hpi_runtime.worker.executor import ExecutorConfig
from hpi_runtime.worker.pp_executor import heartbeat_key
from hpi_runtime.worker.pp_layout import GroupLayout, bind_interface_towards
from hpi_runtime.worker.pp_worker import ABORT_KEY, RankSpec, connect_store, report_failure, run_rank

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 10.0


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/health":
            self.send_error(404, "a pipeline worker host serves only /health; send requests to the leader")
            return
        healthy = self.server.is_healthy()
        self.send_response(200 if healthy else 503)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"ok\n" if healthy else b"not ready\n")

    def log_message(self, format: str, *args) -> None:  # probes every few seconds: keep them out of the log
        pass


def run_worker_host(config: ExecutorConfig, layout: GroupLayout, host: str, port: int) -> int:
    """Serve this host's share of the group until the group ends; returns the exit code."""
    name = f"pipeline host {layout.node_rank}"
    interface = bind_interface_towards(layout.master_addr, layout.master_port, os.environ)
    logger.info("%s: joining the leader at %s:%d (interface %s)", name, layout.master_addr, layout.master_port,
                interface or "gloo's default")  # fmt: skip
    try:
        store = connect_store(layout, is_master=False)
    except Exception as exc:
        logger.error("%s: the leader at %s:%d did not answer within %.0f s: %s", name, layout.master_addr,
                     layout.master_port, layout.timeout_s, exc)  # fmt: skip
        return 1
    context = multiprocessing.get_context("spawn")
    threads = max(1, len(os.sched_getaffinity(0)) // layout.ranks_per_node)  # the cores this host may use
    ranks = {}
    for m in layout.node_model_ranks(layout.node_rank):
        process = context.Process(target=run_rank, args=(RankSpec(m, layout, config, threads),),
                                  name=f"hpi-pp-rank{m}", daemon=True)  # fmt: skip
        process.start()
        ranks[m] = process
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    state = {"ready": False}

    def is_healthy() -> bool:
        return state["ready"] and all(p.is_alive() for p in ranks.values())

    server = ThreadingHTTPServer((host, port), _Health)
    server.is_healthy = is_healthy
    threading.Thread(target=server.serve_forever, name="hpi-pp-health", daemon=True).start()
    logger.info("%s: ranks %s started; GET /health on http://%s:%d", name, list(ranks), host, port)
    try:
        return _watch(store, layout, ranks, state, stop)
    finally:
        server.shutdown()
        for process in ranks.values():
            if process.is_alive():
                process.kill()
            process.join(STOP_TIMEOUT_S)


def _watch(store, layout: GroupLayout, ranks: dict, state: dict, stop: threading.Event) -> int:
    name = f"pipeline host {layout.node_rank}"
    sentinels = {p.sentinel: m for m, p in ranks.items()}
    while not stop.is_set():
        wait(list(sentinels), HEARTBEAT_INTERVAL_S)
        exited = {m: p.exitcode for m, p in ranks.items() if not p.is_alive()}
        if exited and all(code == 0 for code in exited.values()) and len(exited) == len(ranks):
            logger.info("%s: the leader stopped the group; exiting", name)
            return 0
        for m, code in exited.items():
            if code != 0:
                where = f"stage {layout.stage_of(m)}, host {layout.node_rank}"
                message = f"pipeline rank {m} ({where}) {describe_exit(code)}"
                logger.error("%s; stopping this host", message)
                report_failure(store, f"host{layout.node_rank}", message)
                return 1
        try:
            store.add(heartbeat_key(layout.node_rank), 1)
            if store.check([ABORT_KEY]):
                # After the leader's graceful shutdown the ranks have stopped on its word and exit 0: the key it
                # sets last may be seen before they are gone. After a failure they do not stop cleanly.
                if _stopped_cleanly(ranks):
                    return 0
                logger.error("%s: the leader ended the group: %s", name, store.get(ABORT_KEY).decode())
                return 1
            if not state["ready"]:
                state["ready"] = store.check([f"ready/{m}" for m in ranks])
        except Exception as exc:  # the store lives in the leader's engine process
            if _stopped_cleanly(ranks):
                return 0
            logger.error("%s: lost the leader (%s); exiting", name, exc)
            return 1
    logger.info("%s: stopping on a signal", name)
    return 0


def _stopped_cleanly(ranks: dict) -> bool:
    """After a graceful shutdown the leader's store closes as the ranks exit: give them a moment to finish."""
    for process in ranks.values():
        process.join(STOP_TIMEOUT_S / 2)
    return all(p.exitcode == 0 for p in ranks.values())
