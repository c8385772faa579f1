"""The load generator sends a request again when the server closed its connection before answering (a pooled
keep-alive connection closed under it, as llama-server's does), and never once an answer has begun. A raw
HTTP server on a loopback port plays the server, since the point is what happens on the socket."""

from __future__ import annotations

import asyncio
import json

from bench.loadgen import LoadConfig, RequestSpec, run_load

SSE_OK = b"".join([
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
    b'data: {"choices": [{"text": "a"}]}\n\n',
    b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n',
    b"data: [DONE]\n\n",
])  # fmt: skip


async def _read_request(reader: asyncio.StreamReader) -> dict:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return json.loads(await reader.readexactly(length))


async def _serve(behaviours: list[str]) -> tuple[list, int]:
    """Answer connection i as behaviours[i] says: 'drop' (close before any response), 'ok', or 'cut' (headers
    and one token, then close). Returns the load's results and the number of connections made."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        behaviour = behaviours[min(connections, len(behaviours) - 1)]
        connections += 1
        await _read_request(reader)
        if behaviour == "ok":
            writer.write(SSE_OK)
        elif behaviour == "cut":
            writer.write(SSE_OK[: SSE_OK.index(b"data:", SSE_OK.index(b"data:") + 1)])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        config = LoadConfig(f"http://127.0.0.1:{port}", "m", concurrency=1, timeout_s=30)
        run = await run_load([RequestSpec("hello", 3, 2)], config)
    return list(run.results), connections


def test_a_connection_closed_before_any_answer_is_retried():
    results, connections = asyncio.run(_serve(["drop", "ok"]))
    assert connections == 2
    assert [r.ok for r in results] == [True]
    assert results[0].num_output_tokens == 2


def test_retries_are_bounded():
    results, connections = asyncio.run(_serve(["drop"]))
    assert connections == 3  # the first try and two retries
    assert not results[0].ok


def test_an_answer_cut_short_is_an_error_not_a_retry():
    results, connections = asyncio.run(_serve(["cut", "ok"]))
    assert connections == 1
    assert not results[0].ok and results[0].error
