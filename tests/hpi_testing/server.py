"""Start `hpi serve` as a real subprocess on a free loopback port and wait until it is ready; and a loopback
/metrics endpoint that plays a runtime pod for the operator's scrapers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import aiohttp.web
from prometheus_client.parser import text_string_to_metric_families


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (not its resource tracker)."""
    # Each thread lists the children it started.
    children = [child for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]  # fmt: skip
    return [int(child) for child in children
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RuntimeServer:
    """A `hpi serve` process. Use as a context manager; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(
        self,
        model_dir: Path | None,
        log_path: Path,
        *extra_args: str,
        ready_timeout_s: float = 180,
        wait_ready: bool = True,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ):
        """`wait_ready=False` returns as soon as the process is started (to watch it load);
        `env` adds variables to the server's environment; `host` is the address it binds (--host) and is reached
        at; `prefix` runs it under another command (e.g. `ip netns exec NS`, which execs: the pid stays hpi's)."""
        self.port = free_port()
        self.base_url = f"http://{host}:{self.port}"
        self.log_path = log_path
        args = [*prefix, sys.executable, "-m", "hpi_runtime.cli", "serve", "--host", host, "--port", str(self.port),
                *extra_args]  # fmt: skip
        if model_dir is not None:
            args += ["--model", str(model_dir)]
        self._log = open(log_path, "wb")
        server_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        server_env.pop("HPI_API_KEY", None)
        server_env.update(env or {})
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=server_env)
        if wait_ready:
            self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"hpi serve exited with {self.process.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"hpi serve was not ready after {timeout_s} s:\n{self.logs()}")

    def get_json(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()

    def metric_samples(self) -> dict[str, float]:
        return metric_samples(self.metrics_text())

    def tokens_processed(self) -> float:
        """Prompt plus generated tokens so far: a counter that advances while the engine works (the fuzzer's
        `progress`: a long schema-valid request is work, not a hang)."""
        samples = self.metric_samples()
        return samples["vllm:prompt_tokens_total"] + samples["vllm:generation_tokens_total"]

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RuntimeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def post_json(base_url: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{base_url}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())



def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label=value,...}': value}, without the model_name label."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


async def _start(app: aiohttp.web.Application) -> tuple[aiohttp.web.AppRunner, int]:
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def serve_metrics(render: Callable[[], str]) -> tuple[aiohttp.web.AppRunner, int]:
    """A loopback aiohttp server answering GET /metrics with `render()` (Prometheus text): a fake runtime pod's
    metrics for the operator's scrapers. Returns (the runner to clean up, its port)."""

    async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=render(), content_type="text/plain")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", metrics)
    return await _start(app)


@contextlib.asynccontextmanager
async def serving(app: aiohttp.web.Application) -> AsyncIterator[int]:
    """`app` served on a free loopback port for the block (a stand-in pod the operator calls); yields the port."""
    runner, port = await _start(app)
    try:
        yield port
    finally:
        await runner.cleanup()
