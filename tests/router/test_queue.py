"""The router's request queue (hpi_router/queue.py) on its own: the turn passes one request at a time while the
pool has room, in order within a flow, by weighted fair queuing across flows and by priority across bands,
bounded in length and in time, and a waiter that goes away gives its turn on. The pool is a flag here: these
tests are about the queue's order and bounds; test_router_queue.py runs it inside the router."""

from __future__ import annotations

import asyncio
import time

import pytest

from hpi_router.queue import Flow, QueueRejected, RequestQueue


class Room:
    """The pool's room as a switch; `served` records who got the turn, in order."""

    def __init__(self, open_: bool = False):
        self.open = open_


def make(room: Room, max_queued: int = 100, max_wait_s: float = 60.0, events: list | None = None) -> RequestQueue:
    hook = None if events is None else (lambda flow, n, waited: events.append((flow.tenant, n, waited)))
    return RequestQueue(max_queued, max_wait_s, lambda priority: room.open, on_change=hook)


async def enqueue_all(queue: RequestQueue, flows: list[tuple[str, Flow]], served: list[str]) -> list[asyncio.Task]:
    """One task per request: wait for the turn, record it, pass the turn on (as the proxy does)."""

    async def request(name: str, flow: Flow) -> None:
        await queue.admit(flow)
        served.append(name)
        queue.dispatched()

    tasks = []
    for name, flow in flows:
        tasks.append(asyncio.create_task(request(name, flow)))
        await asyncio.sleep(0)  # each reaches the queue before the next: arrival order is the list's
    return tasks


async def test_with_room_and_nobody_waiting_a_request_goes_at_once() -> None:
    queue = make(Room(open_=True))
    await asyncio.wait_for(queue.admit(Flow()), timeout=1)  # no wait at all
    queue.dispatched()
    assert len(queue) == 0


async def test_one_flow_is_first_come_first_served_and_each_request_goes_exactly_once() -> None:
    room, served, events = Room(), [], []
    queue = make(room, events=events)
    tasks = await enqueue_all(queue, [(f"r{i}", Flow()) for i in range(10)], served)
    assert len(queue) == 10 and served == [] and queue.queued() == {Flow(): 10}
    room.open = True
    queue.notify()
    await asyncio.gather(*tasks)
    assert served == [f"r{i}" for i in range(10)] and len(queue) == 0
    assert [n for _, n, waited in events if waited is not None] == list(range(9, -1, -1))  # the gauge, down to 0


async def test_the_turn_passes_only_while_the_pool_has_room() -> None:
    room, served = Room(), []
    queue = make(room)
    tasks = await enqueue_all(queue, [(f"r{i}", Flow()) for i in range(3)], served)

    async def take_one_and_close() -> None:
        await queue.admit(Flow())  # arrives behind the three of its flow: never overtakes them
        served.append("late")
        queue.dispatched()

    late = asyncio.create_task(take_one_and_close())
    await asyncio.sleep(0)
    room.open = True
    queue.notify()
    await asyncio.sleep(0)  # r0 got the turn and takes it...
    room.open = False  # ...and its backend is now full: nobody else goes until room appears again
    await asyncio.wait_for(tasks[0], timeout=1)
    # r0's `dispatched` was the turn's one chance to pass on, and a turn is given synchronously (a waiter leaves
    # the count the moment it is released): all three still waiting means none was let through.
    assert served == ["r0"] and len(queue) == 3
    room.open = True
    queue.notify()
    await asyncio.gather(*tasks, late)
    assert served == ["r0", "r1", "r2", "late"]


async def test_equal_flows_alternate_whatever_their_rates_and_weights_share_in_proportion() -> None:
    room, served = Room(), []
    queue = make(room, max_queued=1000)
    busy, quiet = Flow("busy"), Flow("quiet")
    arrivals = [(f"busy{i}", busy) for i in range(20)] + [(f"quiet{i}", quiet) for i in range(4)]
    tasks = await enqueue_all(queue, arrivals, served)
    room.open = True
    queue.notify()
    await asyncio.gather(*tasks)
    first8 = [name.rstrip("0123456789") for name in served[:8]]
    assert first8.count("quiet") == 4 and first8.count("busy") == 4  # 10x the requests, the same share

    served.clear()
    room.open = False
    heavy, light = Flow("heavy", weight=2.0), Flow("light", weight=1.0)
    arrivals = [(f"heavy{i}", heavy) for i in range(12)] + [(f"light{i}", light) for i in range(12)]
    tasks = await enqueue_all(queue, arrivals, served)
    room.open = True
    queue.notify()
    await asyncio.gather(*tasks)
    first12 = [name.rstrip("0123456789") for name in served[:12]]
    assert first12.count("heavy") == 8 and first12.count("light") == 4  # 2:1 by weight


async def test_a_more_urgent_band_goes_first() -> None:
    room, served = Room(), []
    queue = make(room)
    batch, interactive = Flow("batch", priority=10), Flow("chat", priority=-5)  # lower first, as vLLM's priority
    tasks = await enqueue_all(queue, [(f"b{i}", batch) for i in range(5)] + [("c0", interactive), ("c1", interactive)],
                              served)  # fmt: skip
    room.open = True
    queue.notify()
    await asyncio.gather(*tasks)
    assert served[:2] == ["c0", "c1"] and served[2:] == [f"b{i}" for i in range(5)]


async def test_a_full_queue_refuses_with_a_retry_after() -> None:
    room, served = Room(), []
    queue = make(room, max_queued=3, max_wait_s=50)
    tasks = await enqueue_all(queue, [(f"r{i}", Flow()) for i in range(3)], served)
    with pytest.raises(QueueRejected) as refused:
        await queue.admit(Flow())
    assert refused.value.reason == "full" and refused.value.retry_after_s == 5 and "full" in refused.value.message
    room.open = True
    queue.notify()
    await asyncio.gather(*tasks)
    assert served == ["r0", "r1", "r2"]  # the refusal took nobody's place


async def test_a_request_that_waits_out_its_time_leaves_and_the_rest_keep_their_turns() -> None:
    room, served, events = Room(), [], []
    queue = make(room, max_wait_s=0.05, events=events)
    tasks = await enqueue_all(queue, [("r0", Flow())], served)
    started = time.monotonic()
    with pytest.raises(QueueRejected) as refused:
        await queue.admit(Flow("other"), deadline_s=time.monotonic() + 0.05)
    assert refused.value.reason == "timeout" and time.monotonic() - started >= 0.04
    with pytest.raises(QueueRejected):
        await tasks[0]  # r0 waited out its time too
    assert len(queue) == 0 and queue.queued() == {}
    waited = [w for tenant, _, w in events if w is not None]
    assert len(waited) == 2 and all(w >= 0.04 for w in waited)
    room.open = True
    await asyncio.wait_for(queue.admit(Flow()), timeout=1)  # the timed-out ones hold no place
    queue.dispatched()


async def test_a_waiter_that_goes_away_gives_its_turn_on() -> None:
    room, served = Room(), []
    queue = make(room)
    tasks = await enqueue_all(queue, [(f"r{i}", Flow()) for i in range(3)], served)
    tasks[1].cancel()  # r1's client went away while it waited
    await asyncio.sleep(0)
    room.open = True
    queue.notify()  # r0 is given the turn...
    tasks[0].cancel()  # ...and goes away before it runs again to take it
    await asyncio.wait_for(tasks[2], timeout=1)
    assert served == ["r2"] and len(queue) == 0
    for task in tasks[:2]:
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_closing_refuses_every_waiter_and_every_newcomer() -> None:
    queue = make(Room())
    tasks = await enqueue_all(queue, [(f"r{i}", Flow()) for i in range(3)], [])
    queue.close("shutting down")
    for task in tasks:
        with pytest.raises(QueueRejected, match="shutting down"):
            await task
    with pytest.raises(QueueRejected, match="shutting down"):
        await queue.admit(Flow())
    assert len(queue) == 0


def test_bad_bounds_and_weights_are_value_errors() -> None:
    with pytest.raises(ValueError, match="weight"):
        Flow(weight=0)
    with pytest.raises(ValueError, match="bounds"):
        RequestQueue(-1, 10, lambda priority: True)


def test_with_saturation_gating_the_pick_goes_to_a_backend_with_room() -> None:
    """The queue's order only holds if the request it releases goes where it is served next: an engine already
    queueing would serve its own queue first. So with saturated_waiting set, the pick is among backends with room."""
    from hpi_router.config import PolicySettings
    from hpi_router.pool import BackendPool
    from hpi_router.signals import ScrapeSample

    pool = BackendPool(PolicySettings(affinity_prefix_chars=0), saturated_waiting=2)
    pool.apply(["http://queueing", "http://busy"])
    queueing, busy = pool.get("http://queueing"), pool.get("http://busy")
    for backend in (queueing, busy):
        pool.restore(backend)
    pool.observe(queueing, ScrapeSample(num_running=1, num_waiting=2, kv_usage=0.1, generation_tokens=None, ready=True))
    pool.observe(busy, ScrapeSample(num_running=6, num_waiting=0, kv_usage=0.6, generation_tokens=None, ready=True))
    pool.rescale()
    assert pool.has_room()
    assert [pool.choose(None).url for _ in range(3)] == ["http://busy"] * 3  # never the less loaded, queueing one
    for _ in range(2):
        pool.started(busy)  # sent since its scrape: they wait there too
    assert not pool.has_room() and pool.choose(None) is not None  # none has room: any (the queue holds, or a race)
    ungated = BackendPool(PolicySettings(affinity_prefix_chars=0))
    ungated.apply(["http://queueing", "http://busy"])
    for url in ("http://queueing", "http://busy"):
        ungated.restore(ungated.get(url))
    ungated.observe(ungated.get("http://queueing"), ScrapeSample(num_running=1, num_waiting=2, kv_usage=0.1,
                                                                 generation_tokens=None, ready=True))  # fmt: skip
    ungated.observe(ungated.get("http://busy"), ScrapeSample(num_running=6, num_waiting=0, kv_usage=0.6,
                                                             generation_tokens=None, ready=True))  # fmt: skip
    ungated.rescale()
    assert ungated.choose(None).url == "http://queueing"  # by load alone, as without gating


def test_reserved_slots_hold_the_default_band_off_the_last_slots_an_urgent_request_may_take() -> None:
    from hpi_contracts.pool_profile import PoolProfile
    from hpi_router.config import PolicySettings
    from hpi_router.pool import BackendPool
    from hpi_router.signals import ScrapeSample

    profile = PoolProfile(20.0, 0.0, 1e5, 8, "assumed")  # the engine runs at most 8 sequences
    pool = BackendPool(PolicySettings(affinity_prefix_chars=0), saturated_waiting=1, reserved_slots=2)
    pool.apply(["http://engine"])
    engine = pool.get("http://engine")
    pool.restore(engine)
    pool.observe(engine, ScrapeSample(num_running=5, num_waiting=0, kv_usage=0.5, generation_tokens=None,
                                      ready=True, profile=profile))  # fmt: skip
    pool.rescale()
    assert pool.has_room(0) and pool.has_room(-1)  # 5 of 8: the default band may take the 6th
    pool.started(engine)
    assert not pool.has_room(0) and pool.has_room(-1)  # 6 of 8: the last two are the urgent bands'
    for _ in range(2):
        pool.started(engine)
    assert pool.has_room(-1)  # 8 of 8: one more may wait in the engine (saturated_waiting 1) ...
    pool.started(engine)
    assert not pool.has_room(-1)  # ... and no more
    pool.observe(engine, ScrapeSample(num_running=3, num_waiting=0, kv_usage=0.3, generation_tokens=None,
                                      ready=True, profile=profile))  # fmt: skip
    assert pool.has_room(0)  # the scrape shows slots freed


async def test_an_urgent_arrival_goes_ahead_of_a_band_that_has_no_room() -> None:
    room = {0: False, -1: True}
    queue = RequestQueue(100, 60, lambda priority: room[priority])
    served: list[str] = []
    tasks = await enqueue_all(queue, [("batch0", Flow("batch")), ("batch1", Flow("batch"))], served)
    assert len(queue) == 2
    tasks += await enqueue_all(queue, [("urgent", Flow("chat", priority=-1))], served)
    await asyncio.wait_for(tasks[2], timeout=1)  # it went at once, without waiting for a pool event
    assert served == ["urgent"] and len(queue) == 2
    room[0] = True
    queue.notify()
    await asyncio.gather(*tasks[:2])
    assert served == ["urgent", "batch0", "batch1"]
