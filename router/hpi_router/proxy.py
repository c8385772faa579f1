"""Forward one OpenAI request to a backend and stream its answer back, retrying elsewhere before the first byte.

An attempt fails over to another backend (up to `max_attempts` in all) while nothing has been sent to the
client: connection errors and a backend that dies before its first byte eject it; 503 (draining, loading)
ejects it too; 429 (its queue is full), 502/504 and a LoRA adapter's 404 (not loaded there yet: a pod that has
just started) only move on. Non-streamed answers are read whole before they are sent, so they fail over even when
the backend dies mid-generation. A streamed answer goes out as
the backend's first bytes arrive (hpi holds its headers until the first token, so a refusal at admission
is still a plain HTTP error here) and every chunk is written as it arrives; a backend failure after that
cuts the client's connection (a clean end would pass a truncated answer off as complete). A client that
goes away cancels the handler, which closes the upstream request, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from hpi_router.access import authorize, flow_of, record_usage, upstream_authorization
from hpi_router.affinity import prefix_key
from hpi_router.backends import Backend
from hpi_router.errors import REQUEST_ID, ApiError, bad_request
from hpi_router.monitor import eject
from hpi_router.queue import Flow, QueueRejected
from hpi_router.state import STATE_KEY, RouterState
from hpi_router.tenants import Tenant
from hpi_router.usage import UsageTap, ask_for_usage

logger = logging.getLogger(__name__)

FORWARDED_REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "OpenAI-Organization", "OpenAI-Project")
FORWARDED_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "X-Request-Id", "WWW-Authenticate", "Retry-After")
RETRY_STATUSES = {429: False, 502: False, 503: True, 504: False}  # status -> eject the backend?
CLIENT_CLOSED = 499  # nginx's code for a request whose client went away before the answer: counted, never sent


class AttemptFailed(Exception):
    """This attempt sent nothing to the client; another backend may take the request."""

    def __init__(self, reason: str, detail: str, eject: bool, status: int = 502):
        super().__init__(detail)
        self.reason, self.detail, self.eject, self.status = reason, detail, eject, status


def _parse_body(raw: bytes) -> dict:
    if not raw:
        raise bad_request("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # the C decoder recurses once per nesting level
        raise bad_request("the request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _request_headers(request: web.Request, authorization: str | None) -> dict[str, str]:
    headers = {name: request.headers[name] for name in FORWARDED_REQUEST_HEADERS if name in request.headers}
    headers.pop("Authorization", None)
    if authorization:
        headers["Authorization"] = authorization
    headers["X-Request-Id"] = request[REQUEST_ID]
    return headers


def _response_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {name: upstream.headers[name] for name in FORWARDED_RESPONSE_HEADERS if name in upstream.headers}


async def _attempt(request: web.Request, state: RouterState, backend: Backend, raw: bytes, headers: dict[str, str],
                   tenant: Tenant | None, strip_usage: bool,
                   adapter: str | None = None) -> web.StreamResponse:  # fmt: skip
    """One try on `backend`; raises AttemptFailed while the client has been sent nothing. `tenant`: whose usage
    the answer counts to (None: no tenants); `strip_usage`: the router asked for the stream's usage chunk, the
    client did not; `adapter`: the request's LoRA adapter, whose 404 (not loaded there, as on a pod that has
    just started) moves on to another backend."""
    metrics = state.metrics
    start = time.perf_counter()
    try:
        upstream = await state.session.post(f"{backend.url}{request.path_qs}", data=raw, headers=headers)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise AttemptFailed("connect", f"{type(exc).__name__}: {exc}", eject=True) from None
    try:
        if upstream.status in RETRY_STATUSES:
            detail = (await upstream.text(errors="replace"))[:300]
            raise AttemptFailed(f"http_{upstream.status}", f"HTTP {upstream.status}: {detail}",
                                eject=RETRY_STATUSES[upstream.status], status=upstream.status)
        if adapter is not None and upstream.status == 404:
            detail = (await upstream.text(errors="replace"))[:300]
            raise AttemptFailed("adapter_missing", f"HTTP 404: {detail}", eject=False, status=404)
        streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        try:
            first = await (upstream.content.readany() if streamed else upstream.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise AttemptFailed("before_first_byte", f"{type(exc).__name__}: {exc}", eject=True) from None
        if streamed and not first:
            raise AttemptFailed("before_first_byte", "the backend closed the stream before its first byte",
                                eject=True)
        metrics.first_byte.labels(backend.url).observe(time.perf_counter() - start)
        metrics.requests.labels(backend.url, str(upstream.status)).inc()
        tap = UsageTap(streamed, strip_usage, watch=tenant is not None)
        if not streamed:
            response = web.Response(status=upstream.status, body=tap.feed(first), headers=_response_headers(upstream))
            tap.finish()
            if tenant is not None:
                record_usage(state, tenant, tap.usage)
            metrics.latency.labels(backend.url).observe(time.perf_counter() - start)
            return response
        response = web.StreamResponse(status=upstream.status, headers={**_response_headers(upstream),
                                                                       "X-Accel-Buffering": "no"})
        await response.prepare(request)
        await response.write(tap.feed(first))
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                # Past the first byte nothing can be retried: cut the client off rather than end cleanly. (Only
                # the upstream read is guarded: a client that goes away must not eject the backend.)
                metrics.stream_failures.labels(backend.url).inc()
                eject(state.pool, backend, f"failed mid-stream: {type(exc).__name__}", metrics)
                logger.warning("request %s: %s failed mid-stream (%s); closing the client connection",
                               request[REQUEST_ID], backend.url, exc)
                if request.transport is not None:
                    request.transport.abort()
                return response
            if not chunk:
                break
            if passed := tap.feed(chunk):
                await response.write(passed)
        if left := tap.finish():
            await response.write(left)
        if tenant is not None:
            record_usage(state, tenant, tap.usage)
        await response.write_eof()
        metrics.latency.labels(backend.url).observe(time.perf_counter() - start)
        return response
    finally:
        upstream.close()  # returns nothing to the pool unless fully read; an early exit drops the connection


async def _wait_in_queue(state: RouterState, flow: Flow, deadline_s: float) -> None:
    """Wait for the turn to pick a backend (queue.py); a refusal is a 503 with Retry-After."""
    try:
        await state.queue.admit(flow, deadline_s)
    except QueueRejected as exc:
        state.metrics.unrouted.labels(f"queue_{exc.reason}").inc()
        raise ApiError(503, exc.message, code=f"queue_{exc.reason}",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None


async def proxy(request: web.Request) -> web.StreamResponse:
    state: RouterState = request.app[STATE_KEY]
    if state.draining:
        raise ApiError(503, "the router is shutting down", code="draining")
    body = _parse_body(await request.read())
    tenant = authorize(state, request, body)  # None without a tenants file
    if tenant is None:
        return await _route(request, state, body, None)
    status = 500  # a bug: the error middleware answers 500
    try:
        response = await _route(request, state, body, tenant)
        status = response.status
        return response
    except ApiError as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionError):
        status = CLIENT_CLOSED  # the client went away: nobody was answered
        raise
    finally:
        state.limits.release(tenant)
        state.metrics.tenant_requests.labels(tenant.name, str(status)).inc()


async def _route(request: web.Request, state: RouterState, body: dict, tenant: Tenant | None) -> web.StreamResponse:
    """Wait for a backend (queue.py), try it, fail over before the first byte."""
    # A tenant's body is re-encoded: its priority set, and its stream asked for the usage chunk (usage.py).
    strip_usage = tenant is not None and ask_for_usage(body)
    raw = json.dumps(body).encode() if tenant is not None else await request.read()
    headers = _request_headers(request, upstream_authorization(state, request))
    key = prefix_key(body, state.settings.policy.affinity_prefix_chars)
    adapter = state.pool.adapter_of(body.get("model"))  # a LoRA adapter's requests gather where it is resident
    flow = flow_of(tenant)
    deadline_s = time.monotonic() + state.settings.queue.max_wait_s  # the whole wait, however often it waits
    tried: set[str] = set()
    last: AttemptFailed | None = None
    attempts = 0
    while attempts < state.settings.max_attempts:
        if state.queue.max_queued:  # 0: no queue, no backend is a 503 at once (below)
            await _wait_in_queue(state, flow, deadline_s)
        try:
            choice = state.choose(key, exclude=tried, priority=flow.priority, adapter=adapter)
            if choice is not None:
                backend, pick = choice
                state.pool.started(backend, adapter)
        finally:
            state.queue.dispatched()  # the turn passes on: this request holds its backend, or has none
        if choice is None:
            if state.pool.num_ready() == 0 and state.queue.max_queued:
                continue  # every backend went away since the turn came (the first one died while waking): wait
            break  # the ready ones were all tried
        attempts += 1
        tried.add(backend.url)
        state.metrics.picks.labels(backend.url, pick.reason).inc()
        try:
            return await _attempt(request, state, backend, raw, headers, tenant, strip_usage, adapter)
        except AttemptFailed as exc:
            last = exc
            state.metrics.retries.labels(backend.url, exc.reason).inc()
            if exc.eject:
                eject(state.pool, backend, exc.detail, state.metrics)
            logger.info("request %s: %s failed before the first byte (%s); trying another backend",
                        request[REQUEST_ID], backend.url, exc.detail)
        finally:
            state.pool.finished(backend, adapter)
    if last is None:
        state.metrics.unrouted.labels("no_ready_backend").inc()
        raise ApiError(503, "no backend is ready to take the request", code="no_backend")
    state.metrics.unrouted.labels("attempts_failed").inc()
    if last.status == 404:  # no backend tried has the adapter: the model is unknown, as each of them said
        raise ApiError(404, f"the model {adapter!r} is not loaded on any of the {len(tried)} backend(s) tried; last: "
                            f"{last.detail}", code="model_not_found")  # fmt: skip
    status = 429 if last.status == 429 else 503
    raise ApiError(status, f"{len(tried)} backend(s) failed the request; last: {last.detail}",
                   code="backends_failed")
