"""The router's one request queue: where a request waits while no backend can take it.

Two things make a backend unable to take a request, and this queue serves both:
- **none is ready**: the pool scaled to zero or its pods are still starting. The router is then the activator
  (as Knative's is in front of a revision at zero): it holds the request, the operator reads the queue's length
  (`hpi:router_queued_requests`) as demand and starts a pod, and the request goes out once a backend is ready;
- **all are saturated** (optional, `saturated_waiting`): every ready backend already has that many requests
  waiting in its engine, so one more would only wait there, out of the router's sight; here it waits in order,
  and a burst is absorbed while new replicas start.

Order: requests belong to flows (a tenant at a priority). A more urgent band is always served first (a lower
`priority` value, as vLLM's request priority and the engine's scheduler read it); within a band, flows share by
weighted fair queuing (each request gets a virtual finish tag = max(the band's virtual time, the flow's last
tag) + 1 / weight; the smallest tag goes first), so two flows of equal weight alternate whatever their arrival
rates, and one flow alone is first come, first served.

Release is one at a time: `notify` wakes the next waiter only when the pool can dispatch, and that waiter calls
`dispatched` once it holds its backend (its `started` is counted), which passes the turn on. So a waiter never
overtakes another, and one free slot never releases the whole queue. Bounded in length (`max_queued`: a 503 with
Retry-After beyond it) and in time (`max_wait_s`: the same once waited out). A waiter that goes away (client
disconnect) leaves the queue and passes its turn on if it had been given one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Flow:
    """Whose request it is: requests of one flow keep their order; flows share by weight within a priority."""

    tenant: str = DEFAULT_TENANT
    priority: int = 0  # lower goes first (vLLM's convention, which the engine's scheduler follows)
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a flow's weight must be > 0, got {self.weight}")


class QueueRejected(Exception):
    """The request cannot wait: the queue is full, or it waited `max_wait_s` (reason: full | timeout)."""

    def __init__(self, reason: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.reason, self.message, self.retry_after_s = reason, message, retry_after_s


@dataclass(order=True)
class _Waiter:
    priority: int  # the heap pops the lowest value (the most urgent band) first
    tag: float
    serial: int
    flow: Flow = field(compare=False)
    future: asyncio.Future = field(compare=False)
    since_s: float = field(compare=False)
    gone: bool = field(default=False, compare=False)


class RequestQueue:
    def __init__(self, max_queued: int, max_wait_s: float, can_dispatch: Callable[[int], bool],
                 on_change: Callable[[Flow, int, float | None], None] | None = None):  # fmt: skip
        """`can_dispatch(priority)`: whether the pool can take a request of that priority now (an urgent band may
        find room the others may not take); `on_change(flow, queued, waited_s)`: after each enqueue (waited_s
        None) and each exit (how long it waited), for the metrics."""
        if max_queued < 0 or max_wait_s < 0:
            raise ValueError("the queue's bounds must be >= 0")
        self.max_queued, self.max_wait_s = max_queued, max_wait_s
        self._can_dispatch = can_dispatch
        self._on_change = on_change
        self._heap: list[_Waiter] = []
        self._serial = itertools.count()
        self._virtual: dict[int, float] = {}  # per priority band: the tag of the last request served
        self._last_tag: dict[Flow, float] = {}  # per flow: its last request's tag
        self._queued: dict[Flow, int] = {}
        self._turn_given = False  # a released waiter has not yet called `dispatched`
        self._closed: str | None = None

    def __len__(self) -> int:
        return sum(self._queued.values())

    def queued(self) -> dict[Flow, int]:
        return {flow: n for flow, n in self._queued.items() if n}

    async def admit(self, flow: Flow, deadline_s: float | None = None) -> None:
        """Return when the request may pick a backend; the caller then calls `dispatched()` (always, also when
        its pick fails). At once when nobody waits and the pool can take it; else in turn. `deadline_s`
        (time.monotonic()): when its wait ends (a request that waits again after a failed try keeps its first
        deadline); default: now + max_wait_s. Raises QueueRejected."""
        if self._closed is not None:
            raise QueueRejected("closed", self._closed, 1)
        self._prune()
        if not self._heap and not self._turn_given and self._can_dispatch(flow.priority):
            self._turn_given = True
            return
        if self.max_queued == 0 or len(self) >= self.max_queued:
            raise QueueRejected("full", f"the router's queue is full ({self.max_queued} requests wait for a "
                                "backend); retry later", self._retry_after())  # fmt: skip
        now = time.monotonic()
        deadline_s = now + self.max_wait_s if deadline_s is None else deadline_s
        waiter = self._enqueue(flow, now)
        self.notify()  # an urgent arrival behind waiters of a band that has no room may go at once
        try:  # asyncio.wait neither cancels the future on a timeout nor loses a cancel that races the turn
            await asyncio.wait((waiter.future,), timeout=max(deadline_s - now, 0.0))
        except asyncio.CancelledError:
            if waiter.future.done() and waiter.future.exception() is None:
                self.dispatched()  # given the turn but gone (its client went away): pass it on
            else:
                waiter.gone = True
                self._leave(waiter)
            raise
        if waiter.future.done():
            error = waiter.future.exception()  # closed while it waited
            if error is not None:
                raise error
            return
        waiter.gone = True
        self._leave(waiter)
        raise QueueRejected("timeout", f"no backend could take the request within {self.max_wait_s:g} s (the "
                            "pool may still be starting); retry later", self._retry_after())

    def dispatched(self) -> None:
        """The request given the turn holds its backend (or gave up): the next one may go if the pool can take it."""
        self._turn_given = False
        self.notify()

    def notify(self) -> None:
        """The pool may take requests again (a backend turned ready, a request finished, a scrape came in)."""
        self._prune()
        if self._turn_given or not self._heap or not self._can_dispatch(self._heap[0].priority):
            return  # the head is the most urgent waiter: if it cannot go, a less urgent one may not either
        waiter = heapq.heappop(self._heap)
        self._virtual[waiter.priority] = waiter.tag
        self._leave(waiter)
        self._turn_given = True
        waiter.future.set_result(None)

    def close(self, message: str) -> None:
        """Shutting down: every waiter gets a 503 now, and no one queues again."""
        self._closed = message
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.gone:
                self._leave(waiter)
                waiter.future.set_exception(QueueRejected("closed", message, 1))

    def _enqueue(self, flow: Flow, now: float) -> _Waiter:
        band = self._virtual.get(flow.priority, 0.0)
        tag = max(band, self._last_tag.get(flow, 0.0)) + 1.0 / flow.weight
        self._last_tag[flow] = tag
        waiter = _Waiter(flow.priority, tag, next(self._serial), flow, asyncio.get_running_loop().create_future(),
                         now)  # fmt: skip
        heapq.heappush(self._heap, waiter)
        self._queued[flow] = self._queued.get(flow, 0) + 1
        if self._on_change is not None:
            self._on_change(flow, self._queued[flow], None)
        return waiter

    def _prune(self) -> None:
        """Drop the waiters that left (timed out, went away) from the top of the heap."""
        while self._heap and self._heap[0].gone:
            heapq.heappop(self._heap)

    def _leave(self, waiter: _Waiter) -> None:
        """Count a waiter out (released, timed out or gone); a flow with nothing queued forgets its tag once its
        band's virtual time has passed it (an idle flow gets no credit for the time it was away)."""
        flow = waiter.flow
        self._queued[flow] -= 1
        if not self._queued[flow]:
            del self._queued[flow]
            if self._last_tag.get(flow, 0.0) <= self._virtual.get(flow.priority, 0.0):
                self._last_tag.pop(flow, None)
        if self._on_change is not None:
            self._on_change(flow, self._queued.get(flow, 0), time.monotonic() - waiter.since_s)

    def _retry_after(self) -> int:
        """Seconds a refused client should wait: a tenth of the wait bound, at least 1."""
        return max(1, round(self.max_wait_s / 10))
