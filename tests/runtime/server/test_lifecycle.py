"""Lifecycle: while loading the server is alive but not ready and refuses work with 503; on SIGTERM readiness
drops, new requests get 503, in-flight ones finish and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from hpi_testing.server import RuntimeServer
from hpi_testing.server import post_json as post

LOADING = (503, {"status": "loading"})


def test_loading_server_is_alive_but_not_ready(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The server listens before it imports torch and loads the model (seconds, even for the tiny model), so
    # the first answers come while it loads. A sample counts only when /ready said "loading" both before and
    # after it: the phase only moves forward, so everything in between happened while loading.
    server = RuntimeServer(tiny_model_dir, tmp_path / "server.log", "--served-model-name", "tiny-llama",
                           wait_ready=False)
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        deadline = time.monotonic() + 120
        before, sample = None, None
        while sample is None and time.monotonic() < deadline and server.process.poll() is None:
            try:
                before = server.get_json("/ready")
            except (urllib.error.URLError, ConnectionError):  # not listening yet
                time.sleep(0.02)
                continue
            if before != LOADING:
                break
            during = (server.get_json("/health"), post(server.base_url, "/v1/chat/completions", chat))
            if server.get_json("/ready") == LOADING:
                sample = during
        assert sample is not None, f"no whole sample while loading; /ready said {before}\n{server.logs()}"
        (health_status, _), (post_status, payload) = sample
        assert health_status == 200
        assert post_status == 503 and payload["error"]["code"] == "not_ready", payload
        assert payload["error"]["type"] == "service_unavailable"

        server.wait_ready()
        assert post(server.base_url, "/v1/chat/completions", chat)[0] == 200
        assert server.stop() == 0
    finally:
        server.kill()


def test_sigterm_drains_in_flight_and_exits_zero(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = RuntimeServer(tiny_model_dir, tmp_path / "server.log", "--served-model-name", "tiny-llama",
                           "--max-num-seqs", "4", "--drain-timeout", "60")
    results: dict = {}
    first_chunk = threading.Event()

    def long_stream() -> None:
        body = json.dumps({"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(f"{server.base_url}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        finish, lines = None, 0
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    lines += 1
                    first_chunk.set()
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                    time.sleep(0.01)  # a slow reader keeps the request in flight across the SIGTERM
        results["finish"], results["chunks"] = finish, lines

    try:
        reader = threading.Thread(target=long_stream)
        reader.start()
        assert first_chunk.wait(60), server.logs()
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while server.get_json("/ready")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.get_json("/ready") == (503, {"status": "draining"})
        status, payload = post(server.base_url, "/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert status == 503 and payload["error"]["code"] == "draining"
        reader.join(120)
        assert results == {"finish": "length", "chunks": results["chunks"]} and results["chunks"] >= 100
        assert server.process.wait(60) == 0
    finally:
        server.kill()
