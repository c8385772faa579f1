"""Where every rank of a multi-host group lives (vLLM's layout), and which network interface a rank binds.

A replica of T-way tensor parallelism and P pipeline stages is T * P model ranks over N hosts (`--nnodes`),
T * P / N on each: model rank m is stage m // T, tensor-parallel rank m % T, on host m // (T * P / N). A
stage's ranks share one host (tensor parallelism all-reduces twice per layer; only stage boundaries cross the
link). The leader's engine process joins the torch.distributed world as its rank 0 (the driver: it sends each
step to every rank and receives the last stage's samples); model rank m is world rank m + 1.

Nothing here imports torch: `hpi serve` resolves the group before loading anything.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from hpi_runtime.config import ParallelConfig

# LeaderWorkerSet sets these in every pod of a group (sigs.k8s.io/lws, "Environment variables").
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX = "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"
DEFAULT_MASTER_ADDR = "127.0.0.1"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class GroupLayout:
    """One replica's hosts and ranks, resolved from the flags and the LeaderWorkerSet environment."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout_s: float  # how long the leader waits for every rank to join

    def __post_init__(self) -> None:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is outside a group of {self.nnodes} hosts (nnodes)")
        num_ranks = self.num_model_ranks
        if num_ranks % self.nnodes:
            raise ValueError(
                f"{num_ranks} ranks (tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size}) cannot be spread evenly over {self.nnodes} hosts (nnodes)"
            )
        if self.ranks_per_node % self.tensor_parallel_size:
            raise ValueError(
                f"{self.nnodes} hosts would split a stage's {self.tensor_parallel_size} tensor-parallel ranks across "
                f"hosts; tensor parallelism stays inside a host: nnodes must divide pipeline_parallel_size "
                f"{self.pipeline_parallel_size}"
            )

    @property
    def num_model_ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """The model ranks and the leader's driver."""
        return self.num_model_ranks + 1

    @property
    def ranks_per_node(self) -> int:
        return self.num_model_ranks // self.nnodes

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether this replica needs the pipeline machinery at all (several stages or several hosts)."""
        return self.pipeline_parallel_size > 1 or self.nnodes > 1

    def node_model_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, model_rank: int) -> int:
        return model_rank // self.ranks_per_node

    def stage_of(self, model_rank: int) -> int:
        return model_rank // self.tensor_parallel_size

    def tp_rank_of(self, model_rank: int) -> int:
        return model_rank % self.tensor_parallel_size

    def stage_model_ranks(self, stage: int) -> range:
        t = self.tensor_parallel_size
        return range(stage * t, (stage + 1) * t)

    @property
    def heartbeat_timeout_s(self) -> float:
        """A worker host silent this long is declared dead (a sixth of the join timeout, at least 5 s)."""
        return max(5.0, self.timeout_s / 6)


def resolve_layout(parallel: ParallelConfig, environ: Mapping[str, str]) -> GroupLayout:
    """The flags, else LeaderWorkerSet's environment, else one host at 127.0.0.1. ValueError for a layout that
    does not divide or an environment variable that is not a number."""
    nnodes = parallel.nnodes if parallel.nnodes is not None else _env_int(environ, LWS_GROUP_SIZE, 1)
    node_rank = parallel.node_rank if parallel.node_rank is not None else _env_int(environ, LWS_WORKER_INDEX, 0)
    master_addr = parallel.master_addr or environ.get(LWS_LEADER_ADDRESS) or DEFAULT_MASTER_ADDR
    return GroupLayout(
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=parallel.master_port,
        timeout_s=parallel.distributed_timeout_seconds,
    )


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {text!r}") from None


def interface_towards(address: str, port: int) -> str | None:
    """The name of the network interface this host would send from to reach `address` (its route), or None
    when no interface holds the chosen source address. Hosts of a group may share a hostname (pods, network
    namespaces), so gloo's default, the interface of the hostname's address, may be the wrong one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(address), port))  # UDP: picks the route, sends nothing
        source = probe.getsockname()[0]
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == source:
            return name
    return None


def bind_interface_towards(address: str, port: int, environ: dict[str, str]) -> str | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (each only when unset) to the interface reaching the leader;
    returns the interface gloo will use."""
    if not environ.get("GLOO_SOCKET_IFNAME") or not environ.get("NCCL_SOCKET_IFNAME"):
        name = interface_towards(address, port)
        if name is not None:
            environ.setdefault("GLOO_SOCKET_IFNAME", name)
            environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return environ.get("GLOO_SOCKET_IFNAME")
