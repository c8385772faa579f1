"""The KV cache's host bytes against the memory this process may take (host_memory.py): read from /proc/meminfo and
the cgroup's files, here laid out in a directory of the test's own in the kernel's formats (no container with a
memory limit can be made here), and on this machine's real files; and the check that stops a setting that cannot
fit before any engine process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpi_runtime.config import CacheConfig, EngineArgs
from hpi_runtime.engine_factory import resolve_engine
from hpi_runtime.host_memory import HostMemory, check_kv_host_bytes, read_host_memory

GiB = 1 << 30
MEMINFO = "MemTotal:       24641840 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\nBuffers: 1 kB\n"


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_meminfo_alone_without_a_cgroup_limit(tmp_path: Path) -> None:
    memory = read_host_memory(write(tmp_path, {"proc/meminfo": MEMINFO, "sys/fs/cgroup/memory.max": "max\n",
                                               "sys/fs/cgroup/memory.current": "123456\n"}))  # fmt: skip
    assert memory == HostMemory(mem_available=20 * GiB, cgroup_available=None)
    assert memory.available == 20 * GiB


def test_cgroup_v2_limit_less_what_it_cannot_reclaim(tmp_path: Path) -> None:
    memory = read_host_memory(write(tmp_path, {
        "proc/meminfo": MEMINFO,
        "sys/fs/cgroup/memory.max": f"{8 * GiB}\n",
        "sys/fs/cgroup/memory.current": f"{3 * GiB}\n",
        "sys/fs/cgroup/memory.stat": f"anon 1\nfile 2\ninactive_file {GiB}\nactive_file 5\n",
    }))  # fmt: skip
    assert memory.cgroup_available == 6 * GiB  # 8 - (3 - 1): the inactive page cache can be reclaimed
    assert memory.available == 6 * GiB


def test_cgroup_v1_limit_and_v1_without_one(tmp_path: Path) -> None:
    v1 = {"proc/meminfo": MEMINFO, "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2 * GiB}\n",
          "sys/fs/cgroup/memory/memory.stat": f"inactive_file 7\ntotal_inactive_file {GiB // 2}\n"}  # fmt: skip
    limit = "sys/fs/cgroup/memory/memory.limit_in_bytes"
    limited = read_host_memory(write(tmp_path / "a", {**v1, limit: f"{4 * GiB}"}))
    assert limited.cgroup_available == 4 * GiB - (2 * GiB - GiB // 2)
    unlimited = read_host_memory(write(tmp_path / "b", {**v1, limit: "9223372036854771712\n"}))
    assert unlimited.cgroup_available is None and unlimited.available == 20 * GiB


def test_nothing_readable_checks_nothing(tmp_path: Path) -> None:
    memory = read_host_memory(tmp_path)
    assert memory.available is None
    check_kv_host_bytes(CacheConfig(kv_cache_memory_bytes=10_000 * GiB), "cpu", 1, memory)


def test_this_machine_has_some_memory_available() -> None:
    available = read_host_memory().available
    assert available is not None and 0 < available < 1 << 50


def test_the_bytes_asked_for_by_device_and_ranks() -> None:
    memory = HostMemory(mem_available=10 * GiB, cgroup_available=None)
    check_kv_host_bytes(CacheConfig(kv_cache_memory_bytes=9 * GiB), "cpu", 1, memory)
    check_kv_host_bytes(CacheConfig(kv_cache_memory_bytes=900 * GiB), "cuda", 1, memory)  # on the GPU: not host bytes
    with pytest.raises(ValueError, match=r"needs 18.0 GiB .*--kv-cache-memory 9.0 GiB .* each of 2 tensor-parallel"):
        check_kv_host_bytes(CacheConfig(kv_cache_memory_bytes=9 * GiB), "cpu", 2, memory)
    with pytest.raises(ValueError, match=r"needs 12.0 GiB .*--kv-offload-bytes 12.0 GiB \(the host KV tier\)"):
        check_kv_host_bytes(CacheConfig(kv_offload_bytes=12 * GiB), "cuda", 1, memory)
    with pytest.raises(ValueError, match=r"the default 1.0 GiB .* \+ --kv-offload-bytes 9.5 GiB.*MemAvailable 10.0"):
        check_kv_host_bytes(CacheConfig(kv_offload_bytes=9 * GiB + GiB // 2), "cpu", 1, memory)
    limited = HostMemory(mem_available=10 * GiB, cgroup_available=2 * GiB)
    with pytest.raises(ValueError, match="the container's memory limit leaves 2.0 GiB"):
        check_kv_host_bytes(CacheConfig(kv_cache_memory_bytes=3 * GiB), "cpu", 1, limited)


def test_resolving_an_engine_refuses_a_kv_cache_beyond_the_machine() -> None:
    """Before the check, the core process started and the kernel killed it while it zeroed the cache."""
    with pytest.raises(ValueError, match="the KV cache needs 100000.0 GiB of host memory"):
        resolve_engine(EngineArgs.from_options(kv_cache_memory_bytes=100_000 * GiB, device="cpu"))
