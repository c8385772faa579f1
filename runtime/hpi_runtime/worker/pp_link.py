"""What crosses the wires of a pipeline group: hidden states from stage to stage, and byte messages (pickled steps
and samples) between the leader's driver and the ranks.

Hidden states go from each tensor-parallel rank of a stage to the same rank of the next (after the all-reduce
they are replicated within a stage), by point-to-point send/recv on the model ranks' group (gloo on CPU, NCCL
on GPUs). A send is asynchronous: the stage moves on to its next batch while the previous one's hidden states
are still on the wire (one in flight at a time). The receiver knows the shape from the step it runs.

Messages travel on the world group (gloo, host memory): an int64 header [kind, nbytes], then the bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STEP, SHUTDOWN = 0, 1  # message kinds from the driver
# Every wait names its bound (gloo's default is the group's join timeout): a transfer or collective within one step
# waits at most STEP_TIMEOUT; a rank waits for its next step as long as the server stays idle (failures are found by
# the leader's monitor and the hosts' heartbeats, not by timeouts).
STEP_TIMEOUT = timedelta(minutes=10)
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class LinkStats:
    """A rank's traffic and waits, for the busy-fraction and bytes-per-token figures (bench/bench_multi_node.py)."""

    bytes_sent: int = 0  # hidden states to the next stage
    bytes_received: int = 0  # hidden states from the previous stage and step messages
    wait_s: float = 0.0  # blocked on a receive: the stage had nothing to do


@dataclass
class StageLink:
    """The ends of one rank's pipeline links (global ranks of the previous and next stage's matching rank)."""

    prev_rank: int | None
    next_rank: int | None
    model_group: Any  # the model ranks' process group (no driver): collectives and hidden states
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    stats: LinkStats = field(default_factory=LinkStats)
    _pending: Any = None  # the send in flight and its tensor (kept alive until sent)

    def send(self, hidden: torch.Tensor) -> None:
        """[num_tokens, hidden_size] to the next stage, asynchronously."""
        self.flush()
        hidden = hidden.contiguous()
        self._pending = (dist.isend(hidden, self.next_rank, group=self.model_group), hidden)
        self.stats.bytes_sent += hidden.numel() * hidden.element_size()

    def flush(self) -> None:
        """Wait for the send in flight (before the next one, and before shutting down)."""
        if self._pending is not None:
            self._pending[0].wait(STEP_TIMEOUT)
            self._pending = None

    def recv(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's [num_tokens, hidden_size] for this step."""
        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        started = time.perf_counter()
        dist.irecv(hidden, self.prev_rank, group=self.model_group).wait(STEP_TIMEOUT)
        self.stats.wait_s += time.perf_counter() - started
        self.stats.bytes_received += hidden.numel() * hidden.element_size()
        return hidden

    def min_int(self, value: int) -> int:
        """The smallest `value` over every model rank."""
        device = self.device if dist.get_backend(self.model_group) == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.model_group)
        return int(t.item())


def send_message(payload: bytes, dst: int, kind: int = STEP) -> list:
    """Send a message on the world group asynchronously; returns what to keep alive and wait on."""
    header = torch.tensor([kind, len(payload)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    works = [dist.isend(header, dst)]
    if payload:
        works.append(dist.isend(body, dst))
    return [works, header, body]


def recv_message(src: int, timeout: timedelta = IDLE_TIMEOUT) -> tuple[int, bytes]:
    """(kind, payload) of the next message from `src` on the world group, its header awaited up to `timeout`."""
    header = torch.empty(2, dtype=torch.int64)
    dist.irecv(header, src).wait(timeout)
    kind, nbytes = (int(v) for v in header.tolist())
    if not nbytes:
        return kind, b""
    body = torch.empty(nbytes, dtype=torch.uint8)
    dist.irecv(body, src).wait(STEP_TIMEOUT)
    return kind, body.numpy().tobytes()
