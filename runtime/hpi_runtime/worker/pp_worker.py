"""One model rank of a pipeline group in its own process: join the group, load its stage's layers (its
tensor-parallel shard of them), then run every step the leader's driver sends, in order, until told to stop.

Start-up goes through the leader's TCP store (a key per event, so the leader can name who is missing):
`joined/<m>` once this rank reached the store, then `ready/<m>` (its pickled MemoryFootprint and start-up
phases) or `failed/<m>` (why) after loading. Each step: the pickled SchedulerOutput from the driver, the previous
stage's hidden states (not on the first stage), the forward, the hidden states to the next stage (not on the
last); the last stage's tensor-parallel rank 0 sends the pickled ModelRunnerOutput back to the driver. A step
that fails ends the rank (`failed/<m>`, exit 1): the stages run different batches, so the group cannot go on
without it. A leader that disappears closes the rank's connections and ends it too.

Every second of work the rank publishes `stats/<m>` (JSON: busy and wall seconds, bytes over its links), read by
the leader for the busy-fraction figures.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hpi_runtime.worker.pp_layout import GroupLayout, bind_interface_towards
from hpi_runtime.worker.pp_link import STEP_TIMEOUT

logger = logging.getLogger(__name__)

DRIVER = 0  # the leader's engine process: world rank 0
STATS_INTERVAL_S = 1.0
FAILURES_KEY = "num_failed"  # incremented beside every failed/<who> key, so the leader polls one counter
GROUP_COMPLETE_KEY = "group_complete"  # set by the leader once every rank joined: then the ranks connect
ABORT_KEY = "abort"  # set by the leader (with the reason) when the group ends on a failure
POLL_S = 0.1


@dataclass(frozen=True)
class RankSpec:
    model_rank: int
    layout: GroupLayout
    config: object  # ExecutorConfig (typed loosely, as tp_worker.WorkerSpec)
    num_threads: int  # torch intra-op threads on CPU


def connect_store(layout: GroupLayout, is_master: bool) -> dist.TCPStore:
    """The leader's TCP store (the leader hosts it). A worker retries connecting for the group's timeout."""
    return dist.TCPStore(layout.master_addr, layout.master_port, None, is_master,
                         timeout=timedelta(seconds=layout.timeout_s), wait_for_workers=False)  # fmt: skip


def report_failure(store: dist.TCPStore, who: str, message: str) -> None:
    try:
        store.set(f"failed/{who}", message)
        store.add(FAILURES_KEY, 1)
    except Exception:  # the leader is gone already: nobody to tell
        pass


def create_groups(layout: GroupLayout, backend: str) -> tuple[object, list[object]]:
    """(the model ranks' group, each stage's tensor-parallel group or None): every process of the world,
    the driver included, creates them in the same order. Their operations wait at most STEP_TIMEOUT (a step)."""
    model_group = dist.new_group(list(range(1, layout.world_size)), timeout=STEP_TIMEOUT, backend=backend)
    tp_groups = []
    for stage in range(layout.pipeline_parallel_size):
        ranks = [m + 1 for m in layout.stage_model_ranks(stage)]
        tp_groups.append(dist.new_group(ranks, timeout=STEP_TIMEOUT, backend=backend) if len(ranks) > 1 else None)
    return model_group, tp_groups


def init_world(layout: GroupLayout, store: dist.TCPStore, world_rank: int, backend: str):
    """Join the world (gloo: the driver's messages) and create the groups; returns create_groups'."""
    bind_interface_towards(layout.master_addr, layout.master_port, os.environ)
    # Connecting is bounded by the join timeout; later waits name their own bounds (pp_link.py).
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=world_rank,
                            world_size=layout.world_size, timeout=timedelta(seconds=layout.timeout_s))  # fmt: skip
    return create_groups(layout, backend)


def run_rank(spec: RankSpec) -> None:
    """The process target."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host's process decides when ranks stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [rank {spec.model_rank}]: "
                        "%(message)s")  # fmt: skip
    layout, m = spec.layout, spec.model_rank
    who = f"pipeline rank {m} (stage {layout.stage_of(m)}, host {layout.node_of(m)})"
    try:
        store = connect_store(layout, is_master=False)
    except Exception as exc:
        logger.error("%s could not reach the leader's store at %s:%d: %s", who, layout.master_addr,
                     layout.master_port, exc)  # fmt: skip
        sys.exit(1)
    store.set(f"joined/{m}", "1")
    while not store.check([GROUP_COMPLETE_KEY]):  # the leader's join timeout applies, not each rank's own
        if store.check([ABORT_KEY]):
            logger.error("%s: the leader gave up on the group: %s", who, store.get(ABORT_KEY).decode())
            sys.exit(1)
        time.sleep(POLL_S)
    try:
        executor, link = _start(spec, store)
    except BaseException as exc:
        logger.error("%s failed to start:\n%s", who, traceback.format_exc())
        report_failure(store, str(m), f"{who} failed to start: {type(exc).__name__}: {exc}")
        sys.exit(1)
    store.set(f"ready/{m}", pickle.dumps((executor.footprint, executor.startup)))
    try:
        _serve(spec, store, executor, link)
    except Exception as exc:
        logger.error("%s: step failed:\n%s", who, traceback.format_exc())
        report_failure(store, str(m), f"{who}: {type(exc).__name__}: {exc}")
        sys.exit(1)
    store.set(f"stopped/{m}", "1")


def _start(spec: RankSpec, store: dist.TCPStore):
    from hpi_runtime.models.parallel import SINGLE, PipelineStage, TensorParallel, pipeline_partition, stage_layers
    from hpi_runtime.worker.executor import LocalExecutor
    from hpi_runtime.worker.pp_link import StageLink

    config, layout, m = spec.config, spec.layout, spec.model_rank
    if config.device.type == "cuda":
        device, backend = torch.device("cuda", m % layout.ranks_per_node), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(spec.num_threads)
    model_group, tp_groups = init_world(layout, store, m + 1, backend)
    stage, tp_rank, t = layout.stage_of(m), layout.tp_rank_of(m), layout.tensor_parallel_size
    tp = SINGLE if t == 1 else TensorParallel(tp_rank, t, tp_groups[stage])
    num_stages = layout.pipeline_parallel_size
    link = StageLink(
        prev_rank=None if stage == 0 else m + 1 - t,
        next_rank=None if stage == num_stages - 1 else m + 1 + t,
        model_group=model_group,
        hidden_size=config.model_config.hidden_size,
        dtype=config.dtype,
        device=device,
    )
    layers = stage_layers(pipeline_partition(config.model_config, num_stages, os.environ), stage)
    store.set(f"layers/{m}", f"{layers.start},{layers.stop}")  # the leader checks that the hosts' splits agree
    executor = LocalExecutor(config, tp, device, PipelineStage(stage, num_stages, layers, link))
    logger.info("stage %d of %d: layers %d-%d, tensor-parallel rank %d of %d, %d KV blocks", stage, num_stages,
                layers.start, layers.stop - 1, tp_rank, t, executor.num_kv_blocks)  # fmt: skip
    return executor, link


def _serve(spec: RankSpec, store: dist.TCPStore, executor, link) -> None:
    from hpi_runtime.worker.pp_link import SHUTDOWN, recv_message, send_message

    layout, m = spec.layout, spec.model_rank
    answers = layout.stage_of(m) == layout.pipeline_parallel_size - 1 and layout.tp_rank_of(m) == 0
    in_flight: list = []  # the previous answer's send, kept alive until done
    first_step_at, last_published, num_steps = None, 0.0, 0  # published after the first step, then every second
    while True:
        started = time.perf_counter()
        kind, payload = recv_message(DRIVER)
        if first_step_at is not None:
            link.stats.wait_s += time.perf_counter() - started
        if kind == SHUTDOWN:
            break
        if first_step_at is None:  # the wall clock of the busy fraction starts at the first step
            first_step_at = time.perf_counter()
        link.stats.bytes_received += len(payload)
        output = executor.execute_model(pickle.loads(payload))
        num_steps += 1
        if answers:
            for work in in_flight[0] if in_flight else ():
                work.wait(STEP_TIMEOUT)
            in_flight = send_message(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL), DRIVER)
        if time.monotonic() - last_published >= STATS_INTERVAL_S:
            _publish_stats(store, m, link.stats, time.perf_counter() - first_step_at, num_steps)
            last_published = time.monotonic()
    link.flush()
    for work in in_flight[0] if in_flight else ():
        work.wait(STEP_TIMEOUT)
    if first_step_at is not None:
        _publish_stats(store, m, link.stats, time.perf_counter() - first_step_at, num_steps)
    executor.shutdown()
    dist.destroy_process_group()


def _publish_stats(store: dist.TCPStore, m: int, stats, wall_s: float, num_steps: int) -> None:
    store.set(f"stats/{m}", json.dumps({
        "wall_s": wall_s, "busy_s": max(wall_s - stats.wait_s, 0.0), "num_steps": num_steps,
        "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
    }))  # fmt: skip
