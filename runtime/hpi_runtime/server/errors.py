"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with a fitting status (the shape
and the status -> type table are hpi_contracts.openai_errors', which the router answers with too), and the
server's error middleware (mapping the engine's exceptions onto an ApiError)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from aiohttp import web

from hpi_contracts.openai_errors import error_body

logger = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)  # the client's X-Request-Id, else ours
ErrorMapper = Callable[[Exception, str], "ApiError | None"]  # (exception, request id) -> the error, or None


class ApiError(Exception):
    """An error the client should see; raised anywhere in a handler, rendered by the error middleware."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _no_mapping(exc: Exception, request_id: str) -> ApiError | None:
    return None


def error_middleware(map_error: ErrorMapper = _no_mapping, passthrough: tuple[type[BaseException], ...] = ()):
    """Stamp each request with its id and turn whatever a handler raises into an OpenAI-shaped error:
    ApiError as it is, HTTP errors by their status, `map_error`'s choice for the app's own exceptions, and
    anything else (a bug) into a 500 naming the request id, logged. `passthrough` exceptions propagate."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        request[REQUEST_ID] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return ApiError(exc.status, exc.reason or exc.text or "error").response()
        except passthrough:
            raise
        except Exception as exc:
            error = map_error(exc, request[REQUEST_ID])
            if error is None:  # a bug: fail this request only, with its id in the log
                logger.exception("request %s failed", request[REQUEST_ID])
                error = ApiError(500, f"internal error ({type(exc).__name__}); request id {request[REQUEST_ID]}")
            return error.response()

    return middleware
