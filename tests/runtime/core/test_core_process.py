"""The engine core in its own process (the server's setup), on a real tiny model: streams the same greedy
tokens as the in-process engine, aborts and stop strings free the core's blocks (seen in its stats), a core
that fails to load says why, and a killed core fails every request and is reported dead."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from hpi_runtime.config import EngineArgs
from hpi_runtime.core.core_process import CoreProcessSpec, ProcessCoreClient
from hpi_runtime.engine_factory import create_engine, resolve_engine
from hpi_runtime.frontend.async_engine import AsyncLLM, EngineDeadError
from hpi_runtime.sampling_params import SamplingParams

OPTIONS = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 20}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]


def _spec(model_dir: Path, **options) -> tuple[CoreProcessSpec, object]:
    prepared = resolve_engine(EngineArgs.from_options(model=str(model_dir), **{**OPTIONS, **options}))
    return CoreProcessSpec(prepared.engine_config, prepared.executor_config, prepared.eos_token_ids), prepared


async def _eventually(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture
async def core_llm(tiny_model_dir: Path):
    spec, prepared = _spec(tiny_model_dir)
    llm = AsyncLLM(ProcessCoreClient(spec), prepared.tokenizer, prepared.engine_config)
    await llm.start()
    yield llm
    await llm.shutdown()


async def _run(llm: AsyncLLM, request_id: str, prompt: list[int], params: SamplingParams):
    return [output async for output in llm.generate(request_id, prompt, params)]


async def test_process_core_matches_in_process_engine(core_llm: AsyncLLM, tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    streamed = await asyncio.gather(*(_run(core_llm, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))
    bundle = create_engine(EngineArgs.from_options(model=str(tiny_model_dir), **OPTIONS))
    for i, prompt in enumerate(PROMPTS):
        bundle.engine.add_request(f"r{i}", prompt, params)
    expected = {}
    while bundle.engine.has_unfinished_requests():
        for output in bundle.engine.step():
            if output.finished:
                expected[output.request_id] = output
    bundle.engine.shutdown()
    for i, outputs in enumerate(streamed):
        final = outputs[-1]
        assert final.finished and not any(o.finished for o in outputs[:-1])
        assert [t for o in outputs for t in o.new_token_ids] == list(expected[f"r{i}"].output_token_ids)
        assert final.output_token_ids == expected[f"r{i}"].output_token_ids
        assert "".join(o.text_delta for o in outputs) == final.text == expected[f"r{i}"].text
        assert len([lp for o in outputs for lp in o.new_logprobs]) == 12
    assert core_llm.core_info.footprint.num_kv_blocks > 0 and core_llm.core_info.footprint.weight_bytes > 0
    await _eventually(lambda: core_llm.get_stats().num_generation_tokens == 36)
    assert core_llm.get_stats().kv_cache_usage == 0.0


async def test_abort_and_stop_string_free_the_core_blocks(core_llm: AsyncLLM, tiny_model_dir: Path) -> None:
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async for output in core_llm.generate("abandoned", PROMPTS[2], long):
        if output.new_token_ids:
            break
    await _eventually(lambda: core_llm.get_stats().num_running == 0 and core_llm.get_stats().kv_cache_usage == 0)

    # A stop string taken from what greedy decoding produces: the frontend finds it and aborts the core.
    probe = await _run(core_llm, "probe", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0,
                                                                       ignore_eos=True))
    text = probe[-1].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"greedy text too short to take a stop string from: {text!r}"
    stopped = await _run(core_llm, "stopped", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0,
                                                                         ignore_eos=True, stop=[stop]))
    final = stopped[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[: text.index(stop)]
    assert len(final.output_token_ids) < 200
    await _eventually(lambda: core_llm.get_stats().num_running == 0 and core_llm.get_stats().kv_cache_usage == 0)


async def test_core_that_fails_to_load_says_why(tiny_model_dir: Path) -> None:
    spec, prepared = _spec(tiny_model_dir, kv_cache_memory_bytes=1 << 10)
    llm = AsyncLLM(ProcessCoreClient(spec), prepared.tokenizer, prepared.engine_config)
    with pytest.raises(ValueError, match="KV cache budget of 1024 bytes .* max_model_len"):  # hpi serve exits 2
        await llm.start()


async def test_killed_core_fails_every_request_and_is_reported(core_llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = core_llm.generate("victim", PROMPTS[0], params)
    await anext(stream)
    os.kill(core_llm.client.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="engine core"):
        async for _ in stream:
            pass
    cause = await asyncio.wait_for(core_llm.wait_dead(), 10)
    assert "was killed (SIGKILL: most often the kernel's out-of-memory killer" in str(cause)
    assert core_llm.errored
    with pytest.raises(EngineDeadError):
        await anext(core_llm.generate("after", PROMPTS[0], params))
