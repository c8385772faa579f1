"""The router's GET /openapi.json documents exactly its routes, and schemathesis against a live router (tenants'
keys on, in front of a fake backend: the router's own request handling is what is fuzzed here; the runtime's
parser has its own run in tests/runtime/server/test_fuzz_http.py) finds no server error and no hang."""

from __future__ import annotations

import asyncio

import aiohttp
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_router.affinity import prefix_key
from hpi_router.app import build_app
from hpi_router.config import RouterSettings
from hpi_router.openapi import DOCUMENT
from hpi_router.state import RouterState
from hpi_testing.http_fuzz import fuzz_cases, fuzz_openapi

KEY = "sk-fuzz-0123456789abcdef"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=8)
# Bodies shaped like what the router reads (messages, their content parts, prompts), each part possibly malformed.
PART = st.fixed_dictionaries({}, optional={"type": JSON, "text": JSON})
MESSAGE = st.fixed_dictionaries({}, optional={"role": JSON, "content": st.lists(PART | JSON, max_size=3) | JSON})
BODY = st.fixed_dictionaries({}, optional={"model": JSON, "prompt": st.lists(JSON, max_size=3) | JSON,
                                           "messages": st.lists(MESSAGE | JSON, max_size=3) | JSON, "tools": JSON})


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(body=BODY)
def test_the_affinity_key_takes_any_json_object(body):
    """The router reads the prompt of every body before a backend checks it (a content part whose text was a
    number once made this a 500; schemathesis found it)."""
    key = prefix_key(body, 256)
    assert key is None or isinstance(key, str)


def test_openapi_document_lists_exactly_the_router_routes():
    app = build_app(RouterState(RouterSettings(backend_urls=("http://127.0.0.1:1",))))
    routes = {(route.method.lower(), route.resource.canonical) for route in app.router.routes()
              if route.method not in ("HEAD", "*")}
    documented = {(method, path) for path, item in DOCUMENT["paths"].items() for method in item}
    assert documented == routes


async def test_schemathesis_finds_no_server_error_in_the_router(router, fake_backends, tmp_path,
                                                                  record_property):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"name": "fuzz", "keys": [KEY]}]}))
    backend = await fake_backends(token_delay_s=0.0005)
    backend.max_model_len = 64  # as a real backend with a short context: longer generations are refused
    async with router([backend.url], tenants_file=str(tenants)) as state:
        num_cases = max(20, fuzz_cases() // 2)
        report = await asyncio.to_thread(fuzz_openapi, state.url, num_cases,
                                         headers={"Authorization": f"Bearer {KEY}"})
        record_property("fuzz", report.summary())
        assert report.num_cases >= num_cases // 2, report.summary()
        assert not report.failures, "\n".join(report.failures)
        async with aiohttp.ClientSession() as session:  # still routing, and nothing left counted in flight
            nested = b"[" * 30_000 + b"]" * 30_000  # the JSON decoder recurses per level: a 400, not a 500
            async with session.post(f"{state.url}/v1/completions", data=nested,
                                    headers={"Authorization": f"Bearer {KEY}"}) as response:
                assert response.status == 400 and "nested too deeply" in await response.text()
            async with session.post(f"{state.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                    headers={"Authorization": f"Bearer {KEY}"}) as response:
                assert response.status == 200, await response.text()
        assert state.in_flight == 0 and state.limits.in_flight("fuzz") == 0
