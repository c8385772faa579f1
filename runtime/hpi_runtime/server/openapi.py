"""GET /openapi.json: the runtime's endpoints, with the request bodies its parser reads (hpi_contracts)."""

from __future__ import annotations

from aiohttp import web

from hpi_contracts.openai_requests import CHAT, COMPLETION, DETOKENIZE, TOKENIZE
from hpi_contracts.openapi import OPENAPI_PATH, Operation, openapi_document
from hpi_runtime import __version__

OPERATIONS = (
    Operation("post", "/v1/completions", "Text completion (OpenAI)", COMPLETION, streams=True),
    Operation("post", "/v1/chat/completions", "Chat completion (OpenAI)", CHAT, streams=True),
    Operation("get", "/v1/models", "The served model"),
    Operation("post", "/tokenize", "Tokenize a prompt or a chat (vLLM)", TOKENIZE),
    Operation("post", "/detokenize", "Decode token ids (vLLM)", DETOKENIZE),
    Operation("get", "/version", "The runtime's version"),
    Operation("get", "/health", "Liveness: 200 unless the engine failed"),
    Operation("get", "/ready", "Readiness: 503 while loading, sleeping or draining"),
    Operation("get", "/metrics", "Prometheus metrics (vllm: and hpi:)", content_type="text/plain"),
    Operation("post", "/sleep", "Free the KV cache (level 1) or also the weights (level 2) (vLLM)",
              query={"level": {"type": "integer", "enum": [1, 2], "default": 1}}),
    Operation("post", "/wake_up", "Undo /sleep (vLLM)"),
    Operation("get", "/is_sleeping", "Whether the replica sleeps (vLLM)"),
    Operation("get", OPENAPI_PATH, "This document"),
)
DOCUMENT = openapi_document("hetero-paged-infer runtime", __version__, OPERATIONS)


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(DOCUMENT)
