"""AsyncLLM over the core loop in a thread (ThreadCoreClient, so the core's state can be inspected): streaming,
cancellation that frees blocks before the next step, a failing step that fails only its requests, input
errors before any output, a dead loop that is reported, and priority. The same loop in its own process is
tested in test_core_process.py."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.engine_core import EngineCore
from hpi_runtime.frontend.async_engine import AsyncLLM, EngineDeadError, EngineError
from hpi_runtime.frontend.engine import QueueFullError
from hpi_runtime.sampling_params import SamplingParams


@pytest.fixture
async def make_llm(fake_executor_cls, tokenizer):
    started = []

    async def build(start: bool = True, **config) -> AsyncLLM:
        """`start=False`: the caller changes the core before it starts, then starts it."""
        cfg = EngineConfig(**{"block_size": 8, "max_model_len": 256, **config})
        executor = fake_executor_cls(64, 8, vocab_size=300)
        llm = AsyncLLM.in_thread(EngineCore(cfg, executor, frozenset({tokenizer.eos_token_id})), tokenizer)
        if start:
            await llm.start()
        started.append(llm)
        return llm

    yield build
    for llm in started:
        await llm.shutdown()


async def eventually(condition, timeout_s: float = 5.0) -> None:
    """Aborts reach the core thread before its next step, not synchronously: wait for their effect."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def test_streams_every_token_and_ends_with_finished(make_llm, expected_token):
    llm = await make_llm()
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def collect(rid: str):
        return [output async for output in llm.generate(rid, list(range(20)), params)]

    results = await asyncio.gather(*(collect(f"r{i}") for i in range(5)))
    for i, outputs in enumerate(results):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        tokens = [t for o in outputs for t in o.new_token_ids]
        assert tokens == [expected_token(f"r{i}", 20 + j, 300) for j in range(12)]
        assert "".join(o.text_delta for o in outputs) == outputs[-1].text
    stats = llm.get_stats()
    assert stats.num_generation_tokens == 60 and stats.kv_cache_usage == 0.0


async def test_consumer_break_and_task_cancel_abort_and_free_blocks(make_llm, expected_token):
    llm = await make_llm()
    pool = llm.client.core.kv_cache_manager.pool
    # A slow fake model, so the consumer is cancelled while it waits for the next token.
    llm.client.core.executor.token_fn = lambda rid, pos: time.sleep(0.005) or expected_token(rid, pos, 300)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    num_seen = 0
    async for output in llm.generate("brk", list(range(30)), params):
        num_seen += len(output.new_token_ids)
        assert output.output_token_ids == ()  # intermediate outputs are deltas only
        if num_seen >= 3:
            break  # the abandoned generator is closed by asyncio's async-generator finalizer
    await eventually(lambda: "brk" not in llm.client.core.scheduler.requests and pool.num_free == 64)

    got_one = asyncio.Event()

    async def consume():
        async for _ in llm.generate("cxl", list(range(30)), params):
            got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), 5)
    assert pool.num_free < 64
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: "cxl" not in llm.client.core.scheduler.requests and pool.num_free == 64)
    await eventually(lambda: llm.get_stats().num_running == 0)  # the core reports after applying the abort


async def test_input_errors_surface_before_any_output(make_llm, expected_token):
    llm = await make_llm(max_num_waiting=1, max_model_len=32, max_num_seqs=1)
    with pytest.raises(ValueError, match="max_model_len=32"):
        await anext(llm.generate("long", list(range(40)), SamplingParams()))
    llm.client.core.executor.token_fn = lambda rid, pos: time.sleep(0.005) or expected_token(rid, pos, 300)
    hog = llm.generate("hog", [1], SamplingParams(max_tokens=30, ignore_eos=True))
    await anext(hog)  # running, and the only seat: the next request has to wait
    waiter = llm.generate("waiter", [2], SamplingParams(max_tokens=2))
    first_wait = asyncio.create_task(anext(waiter))
    while llm.get_stats().num_waiting == 0:
        await asyncio.sleep(0.001)
    with pytest.raises(QueueFullError, match="max_num_waiting=1"):
        await anext(llm.generate("refused", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        await anext(llm.generate("hog", [1, 2], SamplingParams()))
    await hog.aclose()
    assert (await first_wait).request_id == "waiter"
    await waiter.aclose()


async def test_failing_step_fails_only_its_requests(make_llm):
    llm = await make_llm(max_num_seqs=1)
    llm.client.core.executor.fail_on = {"bad"}
    good = [o async for o in llm.generate("good", [1] * 10, SamplingParams(max_tokens=3, ignore_eos=True))]
    with pytest.raises(EngineError) as info:
        async for _ in llm.generate("bad", [1] * 10, SamplingParams(max_tokens=3, ignore_eos=True)):
            pass
    assert info.value.request_ids == {"bad"}
    after = [o async for o in llm.generate("after", [1] * 10, SamplingParams(max_tokens=3, ignore_eos=True))]
    assert good[-1].finished and after[-1].finished and not llm.errored
    assert llm.client.core.kv_cache_manager.pool.num_free == 64


async def test_dead_loop_fails_everyone_and_is_reported(make_llm):
    llm = await make_llm()

    def broken_step():
        raise KeyError("scheduler bug")

    llm.client.core.step = broken_step
    with pytest.raises(EngineDeadError):
        async for _ in llm.generate("x", [1, 2, 3], SamplingParams()):
            pass
    assert llm.errored
    with pytest.raises(EngineDeadError):
        await anext(llm.generate("y", [1, 2, 3], SamplingParams()))


class WatchedInbox(queue.Queue):
    """The core loop's inbox, counting the loop's blocking waits on it: an idle loop waits there."""

    def __init__(self) -> None:
        super().__init__()
        self.num_waits = 0

    def get(self, block: bool = True, timeout: float | None = None):
        self.num_waits += block  # get_nowait() is get(block=False)
        return super().get(block, timeout)


@pytest.mark.parametrize("broken", [False, True], ids=["loop", "broken-steps-without-work"])
async def test_idle_loop_waits_on_its_inbox_instead_of_spinning(make_llm, broken):
    llm = await make_llm(start=False)
    core = llm.client.core
    calls = 0
    step = core.step

    def counting_step():
        nonlocal calls
        calls += 1
        return step()

    core.step = counting_step
    if broken:  # a loop that believes there is always work: it steps instead of waiting
        core.has_unfinished_requests = lambda: True
    inbox = llm.client._inbox = WatchedInbox()
    await llm.start()
    # The started loop either waits on its inbox or steps: whichever it does first says whether it idles.
    await eventually(lambda: inbox.num_waits or calls)
    if broken:
        with pytest.raises(AssertionError):
            assert calls == 0
        return
    assert calls == 0
    assert [o async for o in llm.generate("a", [1], SamplingParams(max_tokens=2, ignore_eos=True))][-1].finished
    assert calls >= 2
    await eventually(lambda: inbox.num_waits >= 2)  # done: back to waiting, where it cannot step


async def test_generate_priority_is_admitted_first(make_llm, expected_token):
    llm = await make_llm(max_num_seqs=1)
    llm.client.core.executor.token_fn = lambda rid, pos: time.sleep(0.005) or expected_token(rid, pos, 300)
    first = llm.generate("first", list(range(10)), SamplingParams(max_tokens=20, ignore_eos=True))
    await first.__anext__()  # "first" holds the only seat for ~100 ms: the next two queue behind it

    async def last_output(agen):
        return [output async for output in agen][-1]

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    finals = await asyncio.gather(
        last_output(first),
        last_output(llm.generate("normal", [1, 2, 3], params)),
        last_output(llm.generate("urgent", [1, 2, 3], params, priority=-1)),
    )
    admitted = sorted(finals, key=lambda output: output.first_scheduled_time)
    assert [output.request_id for output in admitted] == ["first", "urgent", "normal"]


async def test_a_prefill_steps_requests_show_as_running_while_it_runs(make_llm, expected_token):
    """A step that prefills can take seconds on a CPU: its stats (vllm:num_requests_running, which the autoscaler
    reads) are published before it runs, not only after it, which would show its requests as not running."""
    llm = await make_llm()
    entered, release = threading.Event(), threading.Event()

    def blocking_token(rid, pos):  # the first step (the prompt's) holds the core until released
        entered.set()
        release.wait(10)
        return expected_token(rid, pos, 300)

    llm.client.core.executor.token_fn = blocking_token
    stream = llm.generate("long", list(range(40)), SamplingParams(max_tokens=2, ignore_eos=True))
    pending = asyncio.ensure_future(anext(stream))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        await eventually(lambda: llm.get_stats().num_running == 1 and llm.get_stats().num_waiting == 0)
        assert not pending.done()  # still inside the step: these stats came before it ended
    finally:
        release.set()
    assert list((await pending).new_token_ids) == [expected_token("long", 40, 300)]
    assert [o async for o in stream][-1].finished


async def test_only_steps_with_prompt_tokens_are_announced(make_llm):
    """A speculative decode step (one token per request plus its drafts) is not a prefill: no extra stats."""
    from hpi_runtime.core.interface import SchedulerOutput

    core = (await make_llm(start=False)).client.core
    calls = []
    core.on_prefill_scheduled = lambda: calls.append(True)

    def step(tokens: int, drafts: tuple[int, ...]) -> SchedulerOutput:
        spec = {"a": drafts} if drafts else {}
        return SchedulerOutput((), (), {"a": tokens, "b": 1}, tokens + 1, spec_token_ids=spec)

    core._announce(step(3, (7, 8)))  # decode: 1 token + 2 drafts, and b's one token
    core._announce(step(1, ()))
    assert calls == []
    core._announce(step(4, (7, 8)))  # one prompt token beside the drafts
    core._announce(step(40, ()))
    assert calls == [True, True]
