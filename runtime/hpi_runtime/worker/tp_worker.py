"""One tensor-parallel rank in its own process: join the process group, load this rank's shard, then run
every step the engine sends until told to stop (or until the engine process goes away).

Protocol over the worker's pipe (pickled tuples): after start-up the worker sends (READY, (this rank's
MemoryFootprint, its start-up phases)) or (FAILED, the exception) and exits; then, for every pickled
SchedulerOutput received, (OK, ModelRunnerOutput on rank 0, None elsewhere) or (FAILED, an exception naming the
rank); for b"sleep:<level>" and b"wake_up", (OK, the bytes this rank freed or restored). The bytes b"shutdown" end
the loop.
"""

from __future__ import annotations

import logging
import pickle
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

READY, OK, FAILED = "ready", "ok", "failed"
SHUTDOWN = b"shutdown"
SLEEP_PREFIX, WAKE_UP = b"sleep:", b"wake_up"  # b"sleep:1" / b"sleep:2": answered (OK, bytes freed or restored)
# How long a collective may wait for a peer before gloo/NCCL give up; peers that die are noticed sooner
# by the engine process, which then stops everyone.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    config: object  # ExecutorConfig (typed loosely: this module must stay importable before torch.distributed)
    init_method: str  # torch.distributed rendezvous, e.g. file:///tmp/hpi-tp-x/store
    num_threads: int  # torch intra-op threads on CPU


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The process target."""
    # Ctrl-C reaches the whole foreground process group; the engine process decides when workers stop
    # (after draining), so a worker must not die of it first and look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        executor = _start(spec)
    except BaseException as exc:  # anything at all: the engine process must hear why this rank is gone
        logger.error("tensor-parallel rank %d failed to start:\n%s", spec.rank, traceback.format_exc())
        _send(conn, (FAILED, _portable(exc, f"tensor-parallel rank {spec.rank} failed to start")))
        raise SystemExit(1) from None
    # Its block counts are already the minimum over ranks; its start-up phases (hpi_runtime/startup.py) beside them.
    _send(conn, (READY, (executor.footprint, executor.startup)))
    try:
        _serve(executor, conn, spec.rank)
    finally:
        executor.shutdown()
        torch.distributed.destroy_process_group()


def _start(spec: WorkerSpec):
    from hpi_runtime.models.parallel import TensorParallel
    from hpi_runtime.worker.executor import LocalExecutor

    config = spec.config
    size = config.parallel.tensor_parallel_size
    if config.device.type == "cuda":
        device, backend = torch.device("cuda", spec.rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(spec.num_threads)
    torch.distributed.init_process_group(
        backend, init_method=spec.init_method, rank=spec.rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    return LocalExecutor(config, TensorParallel(spec.rank, size), device)


def _serve(executor, conn: Connection, rank: int) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the engine process is gone: nobody will send another step
            return
        if message == SHUTDOWN:
            return
        try:
            if message.startswith(SLEEP_PREFIX):  # every rank releases its shard between the same two steps
                reply = (OK, executor.sleep(int(message[len(SLEEP_PREFIX):])))
            elif message == WAKE_UP:
                reply = (OK, executor.wake_up())
            else:
                output = executor.execute_model(pickle.loads(message))
                reply = (OK, output if rank == 0 else None)
        except Exception as exc:  # a failed step; the engine fails its requests and goes on
            logger.exception("tensor-parallel rank %d: step failed", rank)
            reply = (FAILED, RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}"))
        if not _send(conn, reply):
            return


def _portable(exc: BaseException, context: str) -> BaseException:
    """`exc` itself when it survives pickling (so a ValueError stays a ValueError for the caller)."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{context}: {type(exc).__name__}: {exc}")


def _send(conn: Connection, message: tuple) -> bool:
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        return True
    except (BrokenPipeError, OSError):
        return False
