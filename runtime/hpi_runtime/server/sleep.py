"""Sleep mode over HTTP, with vLLM's endpoints: `POST /sleep?level=N` (default 1), `POST /wake_up`,
`GET /is_sleeping` -> {"is_sleeping": bool}.

A sleeping replica frees its KV cache (level 1) or its KV cache and weights (level 2) and reports itself not
ready (/ready 503, hpi:ready 0, hpi:sleeping 1) so that routers and Services send it nothing; a request that
reaches it anyway gets 503 (code `sleeping`), which the router takes as "eject and retry elsewhere". /health
stays 200: a sleeping replica is alive, and restarting it would defeat the point.

Both POSTs are idempotent (sleeping twice or waking an awake replica answers 200 with 0 bytes) and answer once
the core is done: {"is_sleeping", "level", "freed_bytes" | "restored_bytes", "seconds"}. Sleep needs an idle
engine (409 otherwise, as in vLLM); a bad level is a 400. With an API key configured these need it too:
they take a replica out of service.
"""

from __future__ import annotations

from aiohttp import web

from hpi_runtime.frontend.async_engine import EngineBusyError
from hpi_runtime.server.errors import ApiError, bad_request
from hpi_runtime.server.state import STATE_KEY, ServerState

SLEEP_PATHS = ("/sleep", "/wake_up")


def _level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise bad_request(f"level must be 1 or 2, got {raw!r}", param="level") from None
    if level not in (1, 2):
        raise bad_request(f"level must be 1 or 2, got {level}", param="level")
    return level


async def sleep(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    level = _level(request)
    model = state.loaded_model()
    try:
        answer = await model.engine.sleep(level)
    except EngineBusyError as exc:
        raise ApiError(409, str(exc), code="engine_busy") from None
    state.metrics.set_sleeping(True)
    state.metrics.set_ready(state.ready)
    return web.json_response({"is_sleeping": answer.is_sleeping, "level": answer.level,
                              "freed_bytes": answer.num_bytes, "seconds": round(answer.seconds, 4)})


async def wake_up(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    model = state.loaded_model()
    answer = await model.engine.wake_up()
    state.metrics.set_sleeping(False)
    state.metrics.set_ready(state.ready)
    return web.json_response({"is_sleeping": answer.is_sleeping, "level": answer.level,
                              "restored_bytes": answer.num_bytes, "seconds": round(answer.seconds, 4)})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE_KEY].sleeping})


def add_sleep_routes(app: web.Application) -> None:
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
