"""Server-sent events in the OpenAI streaming format: `data: {json}` records ending in `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from aiohttp import web

from hpi_runtime.server.errors import ApiError

logger = logging.getLogger(__name__)


async def send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def serve_stream(
    request: web.Request,
    stream: AsyncIterator,
    render: Callable[[object, object], Awaitable[list[dict]]],
    trailer: Callable[[], Iterable[dict]],
) -> web.StreamResponse:
    """Stream `render(choice, output)` payloads as SSE, then `trailer()`, then [DONE].

    The first output is awaited before the headers go out, so refusals that the engine makes on admission
    (a full queue) still reach the client as a plain HTTP error with its status. A failure after that
    becomes one error event in the stream. A client that goes away ends the stream, which aborts the
    engine requests (the stream's finally-block cancels them).
    """
    try:
        first = await anext(stream)
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        await response.prepare(request)
        try:
            for payload in await render(*first):
                await send(response, payload)
            async for item in stream:
                for payload in await render(*item):
                    await send(response, payload)
            for payload in trailer():
                await send(response, payload)
        except ApiError as exc:
            await send(response, exc.body())
        except (ConnectionError, web.HTTPException):
            raise
        except Exception as exc:  # the engine failed this request: tell the client, keep the server up
            logger.exception("request %s failed mid-stream", request.get("request_id"))
            await send(response, ApiError(500, f"the engine failed this request: {exc}").body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        await stream.aclose()
