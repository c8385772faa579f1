"""The router's aiohttp application: the proxied OpenAI routes, /v1/models from the backends, and its own
/health, /ready and /metrics. Errors have OpenAI's shape (errors.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from hpi_router.access import INVALID_KEY, upstream_authorization
from hpi_router.errors import ApiError, error_middleware
from hpi_router.openapi import OPENAPI_PATH, openapi_json
from hpi_router.proxy import proxy
from hpi_router.state import STATE_KEY, RouterState

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 5.0


@web.middleware
async def inflight_middleware(request: web.Request, handler) -> web.StreamResponse:
    state: RouterState = request.app[STATE_KEY]
    if request.method != "POST":
        return await handler(request)
    state.in_flight += 1
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: RouterState = request.app[STATE_KEY]
    num_ready = state.pool.num_ready()
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if num_ready == 0 and not state.queue.max_queued:
        return web.json_response({"status": "no ready backend", "backends": len(state.pool.all())}, status=503)
    # With no ready backend but a queue, the router is the activator: it takes requests and holds them while the
    # pool starts (its queue is the operator's demand), so it must stay in its Service.
    status = "ready" if num_ready else "queueing: no ready backend"
    return web.json_response({"status": status, "ready_backends": num_ready, "backends": len(state.pool.all()),
                              "queued": len(state.queue)})  # fmt: skip


async def metrics(request: web.Request) -> web.Response:
    state: RouterState = request.app[STATE_KEY]
    state.metrics.refresh(state.pool.all())
    state.metrics.tenant_keys.set(0 if state.tenants is None else state.tenants.current(time.monotonic()).num_keys)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def list_models(request: web.Request) -> web.Response:
    """The union of the ready backends' /v1/models, by model id (the client's credentials go along)."""
    state: RouterState = request.app[STATE_KEY]
    tenant = None
    if state.tenants is not None:  # a tenant sees the models its key may use, nothing of the others'
        tenant = state.tenants.current(time.monotonic()).authenticate(request.headers.get("Authorization"))
        if tenant is None:
            state.metrics.unrouted.labels("invalid_api_key").inc()
            raise ApiError(401, INVALID_KEY, code="invalid_api_key")
    authorization = upstream_authorization(state, request)
    headers = {"Authorization": authorization} if authorization else {}
    timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)

    async def fetch(url: str) -> tuple[int, dict | None]:
        try:
            async with state.session.get(f"{url}/v1/models", headers=headers, timeout=timeout) as response:
                return response.status, (await response.json() if response.status == 200 else None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
            return 0, None

    answers = await asyncio.gather(*(fetch(b.url) for b in state.pool.ready()))
    cards: dict[str, dict] = {}
    for _status, body in answers:
        for card in (body or {}).get("data") or ():
            if isinstance(card, dict) and "id" in card and (tenant is None or tenant.may_use(str(card["id"]))):
                cards.setdefault(card["id"], card)
    if not cards:
        if tenant is not None and any(body for _, body in answers):
            return web.json_response({"object": "list", "data": []})  # this key may use none of them
        if any(status == 401 for status, _ in answers):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        raise ApiError(503, "no ready backend answered /v1/models", code="no_backend")
    return web.json_response({"object": "list", "data": list(cards.values())})


async def not_found(request: web.Request) -> web.Response:
    raise ApiError(404, f"no route {request.method} {request.path} (the router serves /v1/completions, "
                   "/v1/chat/completions, /v1/models, /health, /ready, /metrics, /openapi.json)")


def build_app(state: RouterState) -> web.Application:
    app = web.Application(middlewares=[error_middleware(passthrough=(ConnectionError,)), inflight_middleware],
                          client_max_size=state.settings.max_request_body_bytes)
    app[STATE_KEY] = state
    app.on_startup.append(state.open)
    app.on_cleanup.append(state.close)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get(OPENAPI_PATH, openapi_json)
    app.router.add_post("/v1/completions", proxy)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
