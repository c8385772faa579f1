"""The front door of one request when the router checks tenants' keys (tenants.py): who sent it, whether it may,
what the backend is told, and what it used (usage.py reads it from the answer).

`authorize` -> a Tenant or a 401 (no or unknown key) / 404 (a model the key may not use: the same answer as a
model that does not exist, so a key learns nothing about other tenants' models) / 429 (over a limit, limits.py).
Without a tenants file everything passes through as before: the client's own Authorization reaches the backends.
"""

from __future__ import annotations

import time

from aiohttp import web

from hpi_router.errors import ApiError
from hpi_router.limits import LimitExceeded
from hpi_router.queue import Flow
from hpi_router.state import RouterState
from hpi_router.tenants import Tenant
from hpi_router.usage import Usage

INVALID_KEY = "missing or invalid API key: send 'Authorization: Bearer <key>'"


def authorize(state: RouterState, request: web.Request, body: dict) -> Tenant | None:
    """The request's tenant, counted into its limits (the caller releases it with `state.limits.release`); None
    when the router checks no keys. Sets the engine's `priority` to the tenant's (a client's own is replaced)."""
    if state.tenants is None:
        return None
    ring = state.tenants.current(time.monotonic())
    tenant = ring.authenticate(request.headers.get("Authorization"))
    if tenant is None:
        state.metrics.unrouted.labels("invalid_api_key").inc()
        raise ApiError(401, INVALID_KEY, code="invalid_api_key")
    model = body.get("model")
    if not tenant.may_use(model if isinstance(model, str) else None):
        state.metrics.tenant_requests.labels(tenant.name, "404").inc()
        raise ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
    try:
        state.limits.admit(tenant, time.monotonic())
    except LimitExceeded as exc:
        state.metrics.tenant_requests.labels(tenant.name, "429").inc()
        raise ApiError(429, exc.message, code="rate_limit_exceeded",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None
    body["priority"] = tenant.priority
    return tenant


def flow_of(tenant: Tenant | None) -> Flow:
    return Flow() if tenant is None else Flow(tenant.name, tenant.priority, tenant.weight)


def upstream_authorization(state: RouterState, request: web.Request) -> str | None:
    """What the backends see: the client's own header, or, when the router checked a tenant's key, the pods' key."""
    if state.tenants is None:
        return request.headers.get("Authorization")
    key = state.settings.backend_api_key
    return f"Bearer {key}" if key else None


def record_usage(state: RouterState, tenant: Tenant, usage: Usage | None) -> None:
    """A tenant's answer ended: its tokens go to the usage counters and to its tokens-per-minute window."""
    if usage is None:
        return
    state.metrics.tenant_prompt_tokens.labels(tenant.name).inc(usage.prompt_tokens)
    state.metrics.tenant_completion_tokens.labels(tenant.name).inc(usage.completion_tokens)
    state.limits.record_tokens(tenant, usage.total_tokens, time.monotonic())
