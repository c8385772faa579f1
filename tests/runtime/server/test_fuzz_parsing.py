"""The published OpenAPI document lists exactly the app's routes; and an in-process fuzz of the request path's pure
parts: the request parser, the chat template rendering and the SSE framing. Bodies come from that document
(schemathesis' strategies, schema-valid and schema-violating) and from arbitrary JSON; the only allowed failure is
a 400 ApiError. (The live server's fuzz is in test_bad_input.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from openai._streaming import SSEDecoder
from schemathesis import GenerationMode
from transformers import AutoTokenizer

from hpi_contracts.openai_requests import CHAT, COMPLETION
from hpi_runtime.server.app import build_app
from hpi_runtime.server.chat import render_prompt
from hpi_runtime.server.errors import ApiError
from hpi_runtime.server.openapi import DOCUMENT
from hpi_runtime.server.protocol import parse_chat, parse_completion
from hpi_runtime.server.sse import send
from hpi_runtime.server.state import ServerSettings, ServerState

FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)



def _json(floats: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        st.none() | st.booleans() | st.integers() | floats | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )


json_values = _json(st.floats())  # NaN and infinities too: Python's json reads them


def test_openapi_document_lists_exactly_the_app_routes():
    app = build_app(ServerState(ServerSettings(served_model_name="m")))
    routes = {(route.method.lower(), route.resource.canonical) for route in app.router.routes()
              if route.method != "HEAD"}
    documented = {(method, path) for path, item in DOCUMENT["paths"].items() for method in item}
    assert documented == routes
    for schema in DOCUMENT["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)


def _bodies(path: str, declared) -> st.SearchStrategy:
    """Documented bodies (valid and invalid) and objects whose declared fields hold arbitrary JSON."""
    operation = SCHEMA[path]["POST"]
    generated = st.one_of(*(operation.as_strategy(generation_mode=mode).map(lambda case: case.body)
                            for mode in GenerationMode))
    names = st.sampled_from([f.name for f in declared.fields])
    return generated | st.dictionaries(names, json_values, max_size=6) | json_values


def _parse_or_400(parse, body):
    try:
        return parse(body)
    except ApiError as exc:
        assert exc.status == 400 and exc.message, exc
        return None


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@FUZZ
@given(body=_bodies("/v1/completions", COMPLETION))
def test_completion_parser_answers_every_body_or_400(body):
    _parse_or_400(parse_completion, body)


@FUZZ
@given(body=_bodies("/v1/chat/completions", CHAT))
def test_chat_parser_and_template_answer_every_body_or_400(tokenizer, body):
    parsed = _parse_or_400(parse_chat, body)
    if parsed is not None:  # what the parser lets through, the chat template must render or refuse with a 400
        try:
            token_ids = render_prompt(tokenizer, parsed, parsed.tools)
        except ApiError as exc:
            assert exc.status == 400, exc
        else:
            assert all(isinstance(t, int) for t in token_ids)


class _Recorder:
    """What send() writes to: the bytes of the response (aiohttp's StreamResponse.write, nothing else)."""

    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


@FUZZ
@given(payloads=st.lists(st.dictionaries(st.text(), _json(st.floats(allow_nan=False)), max_size=4),
                         min_size=1, max_size=5))
def test_sse_framing_round_trips_any_payload(payloads):
    """Whatever the text holds (newlines, `data:`, unicode, lone surrogates), each payload is one event that the
    openai client's own SSE decoder reads back unchanged."""
    recorder = _Recorder()

    async def write_all() -> None:
        for payload in payloads:
            await send(recorder, payload)

    asyncio.new_event_loop().run_until_complete(write_all())
    decoder = SSEDecoder()
    events = [event for line in recorder.data.decode().split("\n") if (event := decoder.decode(line)) is not None]
    assert [json.loads(event.data) for event in events] == payloads
