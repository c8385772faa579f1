"""SIGTERM drain: readiness drops, new requests get 503, in-flight ones finish, the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

from hpi_testing.server import RuntimeServer
from hpi_testing.server import post_json as post


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
