"""OpenAI's error shape, which the runtime's server and the router both answer with: clients (the openai SDK,
LangChain, ...) read `error.type` and the HTTP status, and must not see a difference between a replica and
the router in front of it. Dependency-free; each HTTP layer wraps it in its own exception and middleware.
"""

from __future__ import annotations

# HTTP status -> OpenAI's `error.type` (anything else: invalid_request_error).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}} for an answer with HTTP `status`."""
    error_type = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
