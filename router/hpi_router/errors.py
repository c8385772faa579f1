"""The router's API errors in OpenAI's shape (hpi_contracts.openai_errors, as the runtime answers) and the
middleware that stamps each request with its id and turns whatever a handler raises into such an error."""

from __future__ import annotations

import logging
import uuid

from aiohttp import web

from hpi_contracts.openai_errors import error_body

logger = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)  # the client's X-Request-Id, else ours; forwarded to the backend


class ApiError(Exception):
    """An error the client should see; raised anywhere in a handler, rendered by the error middleware."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # e.g. Retry-After

    def response(self) -> web.Response:
        headers = {**({"WWW-Authenticate": "Bearer"} if self.status == 401 else {}), **self.headers}
        body = error_body(self.status, self.message, param=self.param, code=self.code)
        return web.json_response(body, status=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_middleware(passthrough: tuple[type[BaseException], ...] = ()):
    """ApiError as it is, HTTP errors by their status, anything else (a bug) a 500 naming the request id,
    logged. `passthrough` exceptions propagate (a client that went away has no one to answer)."""

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
        except Exception as exc:  # a bug: fail this request only, with its id in the log
            logger.exception("request %s failed", request[REQUEST_ID])
            return ApiError(500, f"internal error ({type(exc).__name__}); request id {request[REQUEST_ID]}").response()

    return middleware
