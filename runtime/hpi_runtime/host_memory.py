"""How much memory this process may still take, and the check that the KV cache's host bytes fit in it.

A KV cache asked for beyond the machine's memory used to start the engine core, which the kernel's out-of-memory
killer then ended while it wrote the cache (exit -9, and on a shared node possibly another process with it). The
bytes are known before anything loads: on a CPU the KV cache itself (--kv-cache-memory, 1 GiB by default), on any
device the host KV tier (--kv-offload-bytes), per tensor-parallel rank on this host. They are checked against
MemAvailable (/proc/meminfo), bounded by the container's cgroup limit (v2 memory.max, or v1
memory.limit_in_bytes) less what the cgroup holds that it cannot reclaim. The weights are not counted (their
in-memory size is known only once loaded and converted): this catches the setting that cannot fit, not one that
fits only barely. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpi_runtime.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig


@dataclass(frozen=True)
class HostMemory:
    mem_available: int | None  # /proc/meminfo's MemAvailable; None where there is no such file
    cgroup_available: int | None  # the cgroup's limit less its unreclaimable use; None: no limit set

    @property
    def available(self) -> int | None:
        known = [b for b in (self.mem_available, self.cgroup_available) if b is not None]
        return min(known) if known else None

    def describe(self) -> str:
        parts = [f"MemAvailable {gib(self.mem_available)}" if self.mem_available is not None else None,
                 f"the container's memory limit leaves {gib(self.cgroup_available)}"
                 if self.cgroup_available is not None else None]  # fmt: skip
        return "; ".join(p for p in parts if p)


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def read_host_memory(root: Path = Path("/")) -> HostMemory:
    """This process's view of memory; `root` is the filesystem's root (a test points it at a directory of its own)."""
    return HostMemory(_mem_available(root / "proc" / "meminfo"), _cgroup_available(root / "sys" / "fs" / "cgroup"))


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # kB
    return None


def _cgroup_available(cgroup: Path) -> int | None:
    """v2: memory.max - (memory.current - inactive_file); v1: limit_in_bytes - (usage_in_bytes - total_inactive_file).
    None where no limit is set (v2 "max"; v1's limit near 2**63) or the files are missing."""
    for limit_file, usage_file, stat_file, inactive in (
        (cgroup / "memory.max", cgroup / "memory.current", cgroup / "memory.stat", "inactive_file"),
        (cgroup / "memory" / "memory.limit_in_bytes", cgroup / "memory" / "memory.usage_in_bytes",
         cgroup / "memory" / "memory.stat", "total_inactive_file"),
    ):  # fmt: skip
        try:
            limit_text, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 62:
            return None
        return max(int(limit_text) - max(usage - _stat(stat_file, inactive), 0), 0)
    return None


def _stat(stat_file: Path, name: str) -> int:
    try:
        for line in stat_file.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def check_kv_host_bytes(cache: CacheConfig, device_type: str, ranks: int, memory: HostMemory | None = None) -> None:
    """ValueError where the KV cache's host bytes for `ranks` tensor-parallel ranks on this host (the cache itself
    on a CPU, the host tier on any device) exceed what this process may take; `memory`: read_host_memory()'s."""
    kv = (cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) if device_type == "cpu" else 0
    asked = (kv + cache.kv_offload_bytes) * ranks
    if asked == 0:
        return
    memory = memory or read_host_memory()
    available = memory.available
    if available is None or asked <= available:
        return
    kv_text = f"--kv-cache-memory {gib(kv)}" if cache.kv_cache_memory_bytes else f"the default {gib(kv)}"
    what = [f"{kv_text} (the KV cache on the CPU)" if kv else None,
            f"--kv-offload-bytes {gib(cache.kv_offload_bytes)} (the host KV tier)" if cache.kv_offload_bytes else None]
    per_rank = " + ".join(w for w in what if w)
    ranks_text = f" for each of {ranks} tensor-parallel ranks" if ranks > 1 else ""
    raise ValueError(f"the KV cache needs {gib(asked)} of host memory ({per_rank}{ranks_text}), more than this "
                     f"process may take: {memory.describe()}; lower the setting (the weights need room too)")
