"""API key (401) and the waiting-queue limit (429) on real servers with those options."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest

from hpi_testing.server import RuntimeServer
from hpi_testing.server import post_json as post

OK_CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("keyed") / "server.log"
    # The key comes from the environment here; tests/runtime/server/test_serve_cli.py covers --api-key.
    with RuntimeServer(tiny_model_dir, log, "--served-model-name", "tiny-llama", "--max-num-seqs", "1",
                       "--max-num-waiting", "2", "--kv-cache-memory", "4MiB", env={"HPI_API_KEY": "s3cret"}) as running:
        yield running


def test_missing_or_wrong_key_is_401(keyed_server) -> None:
    status, payload = post(keyed_server.base_url, "/v1/chat/completions", OK_CHAT)
    assert status == 401 and payload["error"]["type"] == "authentication_error"
    status, payload = post(keyed_server.base_url, "/v1/chat/completions", OK_CHAT,
                           {"Authorization": "Bearer nope"})
    assert status == 401 and "API key" in payload["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_right_key_works_and_probes_need_none(keyed_server) -> None:
    client = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="s3cret", max_retries=0)
    assert client.chat.completions.create(model="tiny-llama", messages=OK_CHAT["messages"], max_tokens=2).choices
    assert keyed_server.get_json("/health")[0] == 200
    assert keyed_server.get_json("/ready")[0] == 200


def test_sleep_and_wake_need_the_key(keyed_server) -> None:
    """They take the replica out of service: a client without the key must not be able to."""
    for path in ("/sleep", "/wake_up"):
        status, payload = post(keyed_server.base_url, path, b"")
        assert status == 401 and payload["error"]["type"] == "authentication_error", payload
    assert keyed_server.get_json("/is_sleeping") == (200, {"is_sleeping": False})
    key = {"Authorization": "Bearer s3cret"}
    assert post(keyed_server.base_url, "/sleep", b"", key)[0] == 200
    assert keyed_server.get_json("/is_sleeping") == (200, {"is_sleeping": True})
    assert post(keyed_server.base_url, "/wake_up", b"", key)[0] == 200
    assert keyed_server.get_json("/ready")[0] == 200


def flood(server, num_requests: int = 12) -> list[int]:
    """Send `num_requests` long chat requests at once; their HTTP statuses (429s checked for shape)."""

    async def run() -> list[int]:
        body = {**OK_CHAT, "max_tokens": 64, "ignore_eos": True}
        headers = {"Authorization": "Bearer s3cret"}
        async with aiohttp.ClientSession(headers=headers) as session:
            async def one() -> int:
                async with session.post(f"{server.base_url}/v1/chat/completions", json=body) as response:
                    payload = await response.json()
                    if response.status == 429:
                        assert payload["error"]["type"] == "rate_limit_error"
                    return response.status
            return await asyncio.gather(*(one() for _ in range(num_requests)))

    return asyncio.run(run())


def test_queue_limit_is_429_not_5xx(keyed_server) -> None:
    statuses = flood(keyed_server)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2  # one running + up to two waiting


def test_refused_requests_are_not_counted_as_finished(keyed_server) -> None:
    """A 429 never ran: it is no request_success (of any reason) and no end-to-end latency sample."""

    def counts() -> tuple[float, float]:
        values = keyed_server.metric_samples()
        finished = sum(v for k, v in values.items() if k.startswith("vllm:request_success_total"))
        return finished, values["vllm:e2e_request_latency_seconds_count"]

    finished_before, e2e_before = counts()
    statuses = flood(keyed_server)
    assert statuses.count(429) >= 1, statuses
    finished_after, e2e_after = counts()
    assert finished_after - finished_before == statuses.count(200)
    assert e2e_after - e2e_before == statuses.count(200)
