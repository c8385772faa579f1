"""GET /openapi.json: the router's endpoints. It forwards the runtime's request bodies, so it documents them with
the same declarations the runtime's parser reads (hpi_contracts.openai_requests)."""

from __future__ import annotations

from aiohttp import web

from hpi_contracts.openai_requests import CHAT, COMPLETION
from hpi_contracts.openapi import OPENAPI_PATH, Operation, openapi_document

OPERATIONS = (
    Operation("post", "/v1/completions", "Text completion (OpenAI), forwarded to a backend", COMPLETION, streams=True),
    Operation("post", "/v1/chat/completions", "Chat completion (OpenAI), forwarded to a backend", CHAT, streams=True),
    Operation("get", "/v1/models", "The ready backends' models (a tenant's key: the ones it may use)"),
    Operation("get", "/health", "Liveness"),
    Operation("get", "/ready", "Readiness: a ready backend, or a queue to hold requests while one starts"),
    Operation("get", "/metrics", "Prometheus metrics (hpi_router_)", content_type="text/plain"),
    Operation("get", OPENAPI_PATH, "This document"),
)
DOCUMENT = openapi_document("hetero-paged-infer router", "0.1.0", OPERATIONS)


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(DOCUMENT)
