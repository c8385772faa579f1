"""The router as the tenant boundary: the tenants file (parsed, checked, kept as digests, re-read on change), the
per-tenant limits, and, through a real router on loopback in front of fake backends, the front door: 401 for no or
an unknown key, 404 for a model the key may not use, 429 with Retry-After over a limit, the tenant's priority and
the pods' key sent upstream, usage per tenant, and fair shares when the fleet is saturated."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import yaml

from hpi_router.cli import main as router_main
from hpi_router.config import QueueSettings
from hpi_router.limits import LimitExceeded, TenantLimits
from hpi_router.tenants import Limits, Tenant, digest, parse_tenants
from hpi_testing.server import metric_samples

KEY_A, KEY_A2, KEY_B = "sk-alpha-0123456789abcdef", "sk-alpha-second-key-000001", "sk-bravo-0123456789abcdef"
BACKEND_KEY = "pod-key-0123456789"
TENANTS = {"tenants": [
    {"name": "alpha", "keys": [KEY_A, KEY_A2], "priority": -1, "weight": 1, "models": ["fake-*"],
     "limits": {"concurrentRequests": 50}},
    {"name": "bravo", "keys": [KEY_B], "models": ["other-model"]},
]}  # fmt: skip


def test_the_tenants_file_is_parsed_and_keeps_only_digests() -> None:
    ring = parse_tenants(TENANTS)
    assert ring.num_keys == 3 and [t.name for t in ring.tenants] == ["alpha", "bravo"]
    alpha = ring.authenticate(f"Bearer {KEY_A}")
    assert alpha == Tenant("alpha", -1, 1.0, ("fake-*",), Limits(None, 50))
    assert ring.authenticate(f"Bearer {KEY_A2}") is alpha and ring.authenticate(f"Bearer {KEY_B}").name == "bravo"
    for bad in (None, "", KEY_A, f"Basic {KEY_A}", "Bearer sk-unknown-0123456789", f"Bearer {KEY_A}x"):
        assert ring.authenticate(bad) is None
    assert alpha.may_use("fake-model") and not alpha.may_use("other-model") and not alpha.may_use(None)
    assert Tenant("any").may_use("whatever")
    held = repr(vars(ring))
    assert KEY_A not in held and digest(KEY_A) in ring._by_digest  # digests, never the keys


@pytest.mark.parametrize("change, message", [
    (lambda t: t["tenants"].append({"name": "alpha", "keys": ["sk-another-0123456789"]}), "unique"),
    (lambda t: t["tenants"][1]["keys"].append(KEY_A), "also alpha's"),
    (lambda t: t["tenants"][0].update(keys=["short"]), "fewer than 16"),
    (lambda t: t["tenants"][0].update(weight=0), "weight"),
    (lambda t: t["tenants"][0].update(priority="high"), "priority"),
    (lambda t: t["tenants"][0].update(limits={"tokensPerDay": 5}), "unknown limits"),
    (lambda t: t["tenants"][0].update(limits={"concurrentRequests": 0}), "concurrentRequests"),
    (lambda t: t["tenants"][0].update(keys=[]), "keys"),
    (lambda t: t.update(tenants={"alpha": {}}), "list `tenants`"),
])  # fmt: skip
def test_a_bad_tenants_file_names_what_is_wrong(change, message) -> None:
    raw = json.loads(json.dumps(TENANTS))
    change(raw)
    with pytest.raises(ValueError, match=message):
        parse_tenants(raw)


def test_limits_count_in_flight_and_a_sliding_minute() -> None:
    limits, tenant = TenantLimits(), Tenant("t", limits=Limits(requests_per_minute=3, concurrent_requests=2))
    limits.admit(tenant, 0.0)
    limits.admit(tenant, 1.0)
    with pytest.raises(LimitExceeded, match="2 requests in flight") as refused:
        limits.admit(tenant, 2.0)
    assert refused.value.retry_after_s == 1 and limits.in_flight("t") == 2  # a refusal counts nothing
    limits.release(tenant)
    limits.admit(tenant, 10.0)  # the third this minute
    limits.release(tenant)
    with pytest.raises(LimitExceeded, match="3 requests in the last minute") as refused:
        limits.admit(tenant, 30.0)
    assert refused.value.retry_after_s == 30  # the first leaves the window at 60 s
    limits.admit(tenant, 60.5)
    assert limits.in_flight("t") == 2
    unlimited = Tenant("free")
    for i in range(100):
        limits.admit(unlimited, float(i))
    assert limits.in_flight("free") == 100


def write(path: Path, tenants: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(tenants))
    tmp.replace(path)  # atomically, as the kubelet swaps a Secret volume's files


async def call(session: aiohttp.ClientSession, url: str, key: str | None, model: str = "fake-model",
               prompt: str = "hi", max_tokens: int = 3) -> tuple[int, dict, dict]:  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "priority": 99}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        return response.status, json.loads(await response.text()), dict(response.headers)


async def test_the_front_door_checks_keys_models_and_limits_and_meters_usage(router, fake_backends, tmp_path,
                                                                             monkeypatch) -> None:  # fmt: skip
    backend = await fake_backends()
    path = tmp_path / "tenants.yaml"
    write(path, TENANTS)
    settings = {"tenants_file": str(path), "backend_api_key": BACKEND_KEY}
    async with router([backend.url], **settings) as state, aiohttp.ClientSession() as session:
        status, body, _ = await call(session, state.url, None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert (await call(session, state.url, "sk-nobody-0123456789abcdef"))[0] == 401
        status, body, _ = await call(session, state.url, KEY_B, model="fake-model")  # bravo may not use it
        assert status == 404 and body["error"]["message"] == "The model 'fake-model' does not exist."
        assert backend.num_requests == 0
        status, body, _ = await call(session, state.url, KEY_A)
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        assert backend.bodies[-1]["priority"] == -1  # the tenant's, not the client's 99
        assert backend.authorizations[-1] == f"Bearer {BACKEND_KEY}"  # the pods' key, never the tenant's
        async with session.get(f"{state.url}/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}) as r:
            assert r.status == 200 and (await r.json())["data"] == []  # bravo sees none of alpha's models
        async with session.get(f"{state.url}/v1/models") as r:
            assert r.status == 401
        samples = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        assert samples["hpi:router_tenant_requests_total{code=200,tenant=alpha}"] == 1
        assert samples["hpi:router_tenant_requests_total{code=404,tenant=bravo}"] == 1
        assert samples["hpi:router_tenant_prompt_tokens_total{tenant=alpha}"] == 1
        assert samples["hpi:router_tenant_completion_tokens_total{tenant=alpha}"] == 3
        assert samples["hpi:router_tenant_keys"] == 3
        assert samples["hpi:router_unrouted_requests_total{reason=invalid_api_key}"] == 3  # 2 + /v1/models

        # Limits: alpha may have one request in flight; a second is refused before it queues.
        limited = json.loads(json.dumps(TENANTS))
        limited["tenants"][0]["limits"] = {"concurrentRequests": 1}
        write(path, limited)
        backend.token_delay_s = 0.05
        await asyncio.sleep(0)
        monkeypatch.setattr(state.tenants, "_checked_at", float("-inf"))  # check now, not in 2 s
        slow = asyncio.create_task(call(session, state.url, KEY_A, max_tokens=20))
        while state.limits.in_flight("alpha") == 0:
            await asyncio.sleep(0.01)
        status, body, headers = await call(session, state.url, KEY_A2)
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and headers["Retry-After"] == "1"
        assert (await slow)[0] == 200 and state.limits.in_flight("alpha") == 0

        # A key added to the file works without a restart; a bad file keeps the last good one.
        added = json.loads(json.dumps(TENANTS))
        added["tenants"][1]["keys"].append("sk-bravo-new-0123456789ab")
        added["tenants"][1]["models"] = ["fake-model"]
        write(path, added)
        monkeypatch.setattr(state.tenants, "_checked_at", float("-inf"))
        assert (await call(session, state.url, "sk-bravo-new-0123456789ab"))[0] == 200
        path.write_text("tenants: [broken")
        monkeypatch.setattr(state.tenants, "_checked_at", float("-inf"))
        assert (await call(session, state.url, KEY_B))[0] == 200 and "not YAML" in state.tenants.error


async def test_two_equal_tenants_share_a_saturated_fleet_whatever_their_rates(router, fake_backends,
                                                                              tmp_path) -> None:  # fmt: skip
    """Both ask for more than the fleet serves, one ten times as much: the queue serves them in turns."""
    backend = await fake_backends(token_delay_s=0.01)
    path = tmp_path / "tenants.yaml"
    write(path, {"tenants": [{"name": "heavy", "keys": ["sk-heavy-0123456789abcdef"]},
                             {"name": "light", "keys": ["sk-light-0123456789abcdef"]}]})  # fmt: skip
    hold = QueueSettings(saturated_waiting=1)  # one request at a time per engine: the rest wait in the router
    async with router([backend.url], tenants_file=str(path), queue=hold, scrape_interval_s=5.0) as state, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:  # fmt: skip
        heavy = [asyncio.create_task(call(session, state.url, "sk-heavy-0123456789abcdef", prompt=f"h{i}"))
                 for i in range(40)]  # fmt: skip
        while len(state.queue) < 30:
            await asyncio.sleep(0.01)
        light = [asyncio.create_task(call(session, state.url, "sk-light-0123456789abcdef", prompt=f"l{i}"))
                 for i in range(4)]  # fmt: skip
        answers = await asyncio.gather(*heavy, *light)
    assert all(status == 200 for status, _, _ in answers)
    order = [b["prompt"][0] for b in backend.bodies]
    first_light = order.index("l")
    # Light's four arrived behind ~30 of heavy's yet are served within the next ten dispatches, in turns.
    assert order[first_light:first_light + 8].count("l") == 4, order


def test_a_router_with_a_bad_or_missing_tenants_file_does_not_start(tmp_path, capsys) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text(yaml.safe_dump({"tenants": [{"name": "x", "keys": ["short"]}]}))
    assert router_main(["--backend", "http://127.0.0.1:9", "--tenants-file", str(bad)]) == 2
    assert "fewer than 16 characters" in capsys.readouterr().err
    assert router_main(["--backend", "http://127.0.0.1:9", "--tenants-file", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
