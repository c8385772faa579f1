"""Tokens per minute and limits across router replicas: the limiter's arithmetic, then, through real routers on
loopback in front of a fake backend, tokens counted from JSON answers and from streams' usage chunks (asked for by
the router, stripped when the client did not ask), a 429 with Retry-After past the limit, and two router replicas
each enforcing half of a tenant's fleet-wide limit."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from hpi_router.cli import build_parser, settings_from_args
from hpi_router.limits import LimitExceeded, TenantLimits
from hpi_router.tenants import Limits, Tenant
from hpi_router.usage import Usage, UsageTap, ask_for_usage
from hpi_testing.server import metric_samples

KEY = "sk-alpha-0123456789abcdef"


def test_tokens_per_minute_refuse_until_enough_of_the_minute_has_passed() -> None:
    tenant, limits = Tenant("t", limits=Limits(tokens_per_minute=100)), TenantLimits()
    limits.admit(tenant, 0.0)
    limits.admit(tenant, 0.5)  # admitted while under the limit: both answers count when they end
    limits.record_tokens(tenant, 60, 1.0)
    limits.record_tokens(tenant, 50, 3.0)
    with pytest.raises(LimitExceeded, match="used 110 tokens in the last minute, over its limit of 100") as refused:
        limits.admit(tenant, 10.0)
    assert refused.value.retry_after_s == 51  # at 61 s the first 60 leave the window: 50 < 100
    assert limits.in_flight("t") == 2  # a refusal counts nothing
    limits.admit(tenant, 61.5)
    assert limits.tokens_in_window("t", 61.5) == 50


def test_each_replica_enforces_its_share_of_the_fleet_wide_limits() -> None:
    assert Limits(600, 32, 200_000).share(3) == Limits(200, 11, 66_667)  # rounded up: never under the limit
    assert Limits(1, None, 5).share(4) == Limits(1, None, 2)
    tenant, half = Tenant("c", limits=Limits(concurrent_requests=3)), TenantLimits(num_replicas=2)
    half.admit(tenant, 0.0)
    half.admit(tenant, 0.0)
    with pytest.raises(LimitExceeded, match="2 requests in flight"):
        half.admit(tenant, 0.0)
    settings = settings_from_args(build_parser().parse_args(["--backend", "http://x:1", "--router-replicas", "3"]))
    assert settings.num_replicas == 3
    with pytest.raises(ValueError, match="router replicas"):
        settings_from_args(build_parser().parse_args(["--backend", "http://x:1", "--router-replicas", "0"]))


def test_the_usage_tap_reads_split_events_and_strips_only_the_chunk_it_asked_for() -> None:
    chunk = b'data: {"choices": [{"index": 0, "text": "a"}]}\r\n\r\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5}}\n\n'
    stream = chunk + usage + b"data: [DONE]\n\n"
    for strip in (True, False):
        tap = UsageTap(streamed=True, strip=strip)
        passed = b"".join(tap.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + tap.finish()
        assert tap.usage == Usage(2, 5) and (usage in passed) is not strip
        assert passed.startswith(chunk.replace(b"\r\n", b"\n")) and passed.endswith(b"data: [DONE]\n\n")
    answer = UsageTap(streamed=False, strip=False)
    assert answer.feed(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 3}}') and not answer.finish()
    assert answer.usage.total_tokens == 4
    untouched = UsageTap(streamed=True, strip=False, watch=False)  # no tenant: bytes pass as they come
    assert untouched.feed(stream[:5]) == stream[:5] and untouched.usage is None
    body = {"stream": True, "stream_options": {"include_usage": False}}
    assert ask_for_usage(body) and body["stream_options"] == {"include_usage": True}
    assert not ask_for_usage({"stream": True, "stream_options": {"include_usage": True}})
    assert not ask_for_usage({"stream": False}) and not ask_for_usage({"stream": True, "stream_options": 3})


def _tenants(path: Path, limits: dict) -> str:
    path.write_text(yaml.safe_dump({"tenants": [{"name": "alpha", "keys": [KEY], "limits": limits}]}))
    return str(path)


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str, dict]:
    async with session.post(f"{url}/v1/completions", json={"prompt": "hi", **body},
                            headers={"Authorization": f"Bearer {KEY}"}) as response:
        return response.status, await response.text(), dict(response.headers)


def _events(text: str) -> list:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
            for line in text.split("\n") if line.startswith("data: ")]  # fmt: skip


async def test_tokens_per_minute_count_answers_and_streams(router, fake_backends, tmp_path) -> None:
    backend = await fake_backends()
    async with router([backend.url], tenants_file=_tenants(tmp_path / "t.yaml", {"tokensPerMinute": 12})) as state, \
            aiohttp.ClientSession() as session:  # fmt: skip
        # A stream whose client did not ask for usage: the router asks for it, counts it, and strips it.
        status, text, _ = await _post(session, state.url, {"max_tokens": 4, "stream": True})
        assert status == 200 and backend.bodies[-1]["stream_options"] == {"include_usage": True}
        events = _events(text)
        assert events[-1] == "[DONE]" and len(events) == 5 and all("usage" not in e for e in events[:-1])
        assert state.limits.tokens_in_window("alpha", time.monotonic()) == 5  # 1 prompt + 4 completion tokens
        # A client that asked for it gets its usage chunk.
        status, text, _ = await _post(session, state.url, {"max_tokens": 2, "stream": True,
                                                           "stream_options": {"include_usage": True}})
        assert status == 200 and _events(text)[-2]["usage"]["completion_tokens"] == 2
        # 8 of 12 used: one more is admitted (a JSON answer, 4 tokens), then the minute is spent.
        status, text, _ = await _post(session, state.url, {"max_tokens": 3})
        assert status == 200 and json.loads(text)["usage"]["total_tokens"] == 4
        status, text, headers = await _post(session, state.url, {"max_tokens": 3})
        error = json.loads(text)["error"]
        assert status == 429 and error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "used 12 tokens in the last minute" in error["message"] and 1 <= int(headers["Retry-After"]) <= 60
        assert backend.num_requests == 3  # refused before it reached a backend
        samples = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        assert samples["hpi:router_tenant_prompt_tokens_total{tenant=alpha}"] == 3
        assert samples["hpi:router_tenant_completion_tokens_total{tenant=alpha}"] == 9
        assert samples["hpi:router_tenant_requests_total{code=429,tenant=alpha}"] == 1


async def test_two_router_replicas_each_enforce_half_of_the_limit(router, fake_backends, tmp_path) -> None:
    backend = await fake_backends(token_delay_s=0.05)
    tenants = _tenants(tmp_path / "t.yaml", {"concurrentRequests": 2})
    async with router([backend.url], tenants_file=tenants, num_replicas=2) as a, \
            router([backend.url], tenants_file=tenants, num_replicas=2) as b, \
            aiohttp.ClientSession() as session:  # fmt: skip
        slow = [asyncio.create_task(_post(session, replica.url, {"max_tokens": 20})) for replica in (a, b)]
        while a.limits.in_flight("alpha") == 0 or b.limits.in_flight("alpha") == 0:
            await asyncio.sleep(0.01)
        for replica in (a, b):  # the fleet holds 2, one per replica: a third is refused by either
            status, text, headers = await _post(session, replica.url, {"max_tokens": 1})
            assert status == 429 and "1 requests in flight" in json.loads(text)["error"]["message"]
        assert [status for status, _, _ in await asyncio.gather(*slow)] == [200, 200]
