"""The aiohttp application: routes, authentication, in-flight accounting and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from hpi_runtime.frontend.async_engine import EngineDeadError, EngineSleepingError
from hpi_runtime.frontend.engine import EngineError, QueueFullError
from hpi_runtime.server.chat import create_chat_completion
from hpi_runtime.server.completions import create_completion
from hpi_runtime.server.errors import REQUEST_ID, ApiError
from hpi_runtime.server.errors import error_middleware as shared_error_middleware
from hpi_runtime.server.lora import add_lora_routes
from hpi_runtime.server.openapi import OPENAPI_PATH, openapi_json
from hpi_runtime.server.sleep import SLEEP_PATHS, add_sleep_routes
from hpi_runtime.server.state import STATE_KEY, ServerState
from hpi_runtime.server.tokenize import detokenize, tokenize, version

logger = logging.getLogger(__name__)


def map_engine_error(exc: Exception, request_id: str) -> ApiError | None:
    """The engine's exceptions as the client sees them; None for anything else (a bug: a logged 500)."""
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), code="queue_full")
    if isinstance(exc, ValueError):  # the engine's admission checks: input it cannot take is a client error
        return ApiError(400, str(exc))
    if isinstance(exc, EngineSleepingError):  # asleep since the frontend admitted it: a router retries elsewhere
        return ApiError(503, str(exc), code="sleeping")
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, EngineError):
        logger.error("request %s failed in the engine: %s", request_id, exc)
        return ApiError(500, f"the engine failed this request: {exc}")
    return None


# The client going away mid-response propagates (TimeoutError classes are distinct before Python 3.11).
error_middleware = shared_error_middleware(map_engine_error, (ConnectionError, TimeoutError, asyncio.TimeoutError))


CORS_ALLOW_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600


def _allowed_origin(request: web.Request) -> str | None:
    """The Access-Control-Allow-Origin value for this request, or None (no CORS configured, or not allowed)."""
    origin = request.headers.get("Origin")
    allowed = request.app[STATE_KEY].settings.allowed_origins
    if origin is None or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


@web.middleware
async def cors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Answers CORS preflights (before authentication: browsers send no credentials on them)."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        origin = _allowed_origin(request)
        if origin is None:
            raise ApiError(403, "this origin is not allowed (see --allowed-origins)")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": CORS_ALLOW_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
            "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
        })
    return await handler(request)


async def _add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """X-Request-Id (the client's, else ours) on every response, streams included; CORS headers if allowed."""
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]
    origin = _allowed_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
        if origin != "*":
            response.headers["Vary"] = "Origin"


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    api_key = request.app[STATE_KEY].settings.api_key
    if api_key and (request.path.startswith("/v1/") or request.path in SLEEP_PATHS):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return await handler(request)


@web.middleware
async def inflight_middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.method != "POST":
        return await handler(request)
    state: ServerState = request.app[STATE_KEY]
    state.request_started()
    try:
        return await handler(request)
    finally:
        state.request_finished()


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    if state.model is not None and getattr(state.model.engine, "errored", False):
        return web.json_response({"status": "engine failed"}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    if state.ready:
        return web.json_response({"status": "ready"})
    if state.model is not None and getattr(state.model.engine, "errored", False):
        reason = "engine failed"
    elif state.draining:
        reason = "draining"
    elif state.model is None:
        reason = "load failed" if state.load_error else "loading"
    else:
        reason = "sleeping"
    return web.json_response({"status": reason}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    if state.model is not None:
        state.metrics.refresh(state.model.engine.get_stats())
    state.metrics.set_ready(state.ready)
    state.metrics.set_sleeping(state.sleeping)
    state.refresh_pool_profile()
    return web.Response(body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def list_models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    model = state.admit()
    created = int(time.time())
    card = {"id": model.name, "object": "model", "created": created, "owned_by": "hetero-paged-infer",
            "root": model.name, "parent": None, "max_model_len": model.max_model_len}  # fmt: skip
    adapters = [{"id": lora.lora_name, "object": "model", "created": created, "owned_by": "hpi",
                 "root": lora.lora_path, "parent": model.name} for lora in (model.loras or ())]  # fmt: skip
    return web.json_response({"object": "list", "data": [card, *adapters]})


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, cors_middleware, auth_middleware, inflight_middleware],
        client_max_size=state.settings.max_request_body_bytes,
    )
    app[STATE_KEY] = state
    app.on_response_prepare.append(_add_response_headers)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get(OPENAPI_PATH, openapi_json)
    add_sleep_routes(app)
    if state.settings.allow_runtime_lora_updating:
        add_lora_routes(app)
    return app
