"""`hpi serve --tensor-parallel-size 2` with real worker processes (spawned by the engine-core process): it
serves, and when a worker is killed mid-request the server fails that request, drops readiness and exits 1
instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from hpi_testing.server import RuntimeServer, spawned_children
from hpi_testing.server import post_json as post

pytestmark = pytest.mark.slow


def core_and_worker_pids(server_pid: int) -> tuple[int, list[int]]:
    """The server's engine-core process and the tensor-parallel workers that the core spawned."""
    (core_pid,) = spawned_children(server_pid)
    return core_pid, spawned_children(core_pid)


def test_killed_worker_fails_the_request_and_the_server_exits(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = RuntimeServer(tiny_model_dir, tmp_path / "server.log", "--served-model-name", "tiny",
                           "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256",
                           "--kv-cache-memory", "8MiB")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
        assert done.usage.completion_tokens == 8
        core_pid, pids = core_and_worker_pids(server.process.pid)
        assert len(pids) == 2, server.logs()

        outcome: dict = {}
        streaming = threading.Event()

        def long_stream() -> None:
            chunks = 0
            try:
                stream = client.completions.create(model="tiny", prompt="Once", max_tokens=240, stream=True,
                                                   extra_body={"ignore_eos": True})  # fmt: skip
                for _ in stream:
                    chunks += 1
                    streaming.set()
                    time.sleep(0.02)  # a slow reader keeps the request in flight across the kill
                outcome["ended"] = "normally"
            except Exception as exc:  # what the client sees when the server fails the request
                outcome["ended"] = f"{type(exc).__name__}: {exc}"
            outcome["chunks"] = chunks

        reader = threading.Thread(target=long_stream)
        reader.start()
        assert streaming.wait(60), server.logs()
        os.kill(pids[1], signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive(), "the stream hung after the worker died"
        assert outcome["ended"] != "normally" and outcome["chunks"] < 240, outcome

        assert server.process.wait(60) == 1, server.logs()
        logs = server.logs()
        assert "tensor-parallel worker rank 1" in logs and "was killed by signal 9" in logs
        assert all(not Path(f"/proc/{pid}").exists() for pid in [core_pid, *pids])  # nothing outlived the server
    finally:
        server.stop()


def test_ctrl_c_to_the_process_group_drains_and_exits_zero(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the group; the core and the workers leave the stopping to the server."""
    server = RuntimeServer(tiny_model_dir, tmp_path / "server.log", "--tensor-parallel-size", "2",
                           "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8MiB")  # fmt: skip
    try:
        # Sleep mode over the workers: every rank releases its shard and restores it; the answer is unchanged.
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        model = client.models.list().data[0].id
        before = client.completions.create(model=model, prompt="the sleeping", max_tokens=8,
                                           temperature=0).choices[0].text  # fmt: skip
        status, asleep = post(server.base_url, "/sleep?level=2", b"")
        assert status == 200 and asleep["freed_bytes"] > 0, asleep
        assert server.get_json("/ready")[0] == 503
        status, awake = post(server.base_url, "/wake_up", b"")
        assert status == 200 and awake["restored_bytes"] == asleep["freed_bytes"], awake
        assert server.get_json("/ready") == (200, {"status": "ready"})
        after = client.completions.create(model=model, prompt="the sleeping", max_tokens=8,
                                          temperature=0).choices[0].text  # fmt: skip
        assert after == before
        phases = server.metric_samples()  # start-up phases: each the slowest rank's, through the core's CoreInfo
        assert phases["hpi:startup_phase_seconds{phase=load}"] > 0
        assert phases["hpi:startup_phase_seconds{phase=compile}"] > 0
        core_pid, pids = core_and_worker_pids(server.process.pid)
        assert len(pids) == 2, server.logs()
        pids.append(core_pid)
        for pid in [*pids, server.process.pid]:  # what the terminal does to the foreground process group
            os.kill(pid, signal.SIGINT)
        assert server.process.wait(60) == 0, server.logs()
        logs = server.logs()
        assert "Traceback" not in logs and "tensor-parallel worker" not in logs  # no worker died of it
        assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        server.stop()
