"""Tensor parallelism across real worker processes (gloo on CPU): same tokens as one process, and a dead
worker ends the engine instead of hanging it.

Sums are split across ranks, so logits differ from the single-process run by float rounding only; greedy
tokens must match exactly, logprobs to 1e-4.

Each rank compiles its model step by default, which costs tens of seconds per engine on a 2-core machine: one
case here runs compiled (and test_tensor_parallel_server.py serves compiled), the others eagerly, since what they
check is the sharding, which is the same in both.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from hpi_runtime.core.interface import ExecutorDeadError
from hpi_runtime.frontend.async_engine import AsyncLLM, EngineDeadError
from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.tp_executor import STRAGGLER_TIMEOUT_S

pytestmark = pytest.mark.slow

KV_BYTES = 16 << 20
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "hello",
    "Paged attention keeps the keys and values of every request in fixed-size blocks " * 3,  # chunked
]


def _tiny_llm(model_dir: Path, tp_size: int, **kwargs) -> LLM:
    return LLM(model_dir, tensor_parallel_size=tp_size, dtype="float32", max_model_len=256,
               max_num_batched_tokens=48, kv_cache_memory_bytes=KV_BYTES, **kwargs)  # fmt: skip


def _collect_logprobs(llm: LLM, params: list[SamplingParams]):
    """Token ids and per-token logprobs, streamed (RequestOutput deltas carry the logprobs)."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(PROMPTS * 2, params, strict=True)):
        engine.add_request(str(i), llm.tokenizer.encode(prompt, add_special_tokens=False), p)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.new_logprobs)
    return [(tokens[str(i)], logprobs[str(i)]) for i in range(len(params))]


SAMPLING = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)] * len(PROMPTS) + [
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7 + i, logprobs=1, ignore_eos=True)
    for i in range(len(PROMPTS))
]


@pytest.mark.parametrize(
    ("arch", "overrides", "tp_size", "eager"),
    [
        ("llama", dict(num_heads=6, num_kv_heads=3, hidden_size=96, intermediate_size=160, mlp_bias=True), 2, False),
        ("qwen2", dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False), 2, True),
        ("llama", dict(num_heads=8, num_kv_heads=2), 4, True),  # more ranks than KV heads: KV heads replicated
        # sliding-window and global layers, soft-capping, sandwich norms, the (1 + w) norm, embedding scale
        ("gemma2", dict(sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0), 2, True),
        ("phi3", dict(num_heads=6, num_kv_heads=3, hidden_size=96, intermediate_size=160), 2, True),  # fused
    ],
    ids=["uneven-heads-mlp-bias-compiled", "qwen2-biases-untied-head", "replicated-kv-heads", "gemma2", "phi3-fused"],
)
def test_tensor_parallel_matches_one_process(tiny_model_factory, arch, overrides, tp_size, eager) -> None:
    model_dir = tiny_model_factory(arch, **overrides)
    with _tiny_llm(model_dir, 1, enforce_eager=eager) as llm:
        expected = _collect_logprobs(llm, SAMPLING)
    with _tiny_llm(model_dir, tp_size, enforce_eager=eager) as llm:
        assert llm.bundle.footprint.num_kv_blocks > 0
        got = _collect_logprobs(llm, SAMPLING)
    for (want_ids, want_lps), (got_ids, got_lps) in zip(expected, got, strict=True):
        assert got_ids == want_ids
        assert got_lps == pytest.approx(want_lps, abs=1e-4)
    assert multiprocessing.active_children() == []  # the workers are gone after shutdown


def test_embedded_model_tp2_equals_tp1(embedded_model_dir: Path) -> None:
    """9 query / 3 KV heads over 2 ranks: 6 + 3 heads, the uneven case."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Kubernetes operators reconcile"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    runs = {}
    for tp_size in (1, 2):
        with LLM(embedded_model_dir, tensor_parallel_size=tp_size, dtype="float32", max_model_len=256,
                 kv_cache_memory_bytes=32 << 20, enforce_eager=True) as llm:  # fmt: skip
            runs[tp_size] = [o.output_token_ids for o in llm.generate(prompts, greedy)]
    assert runs[2] == runs[1]
    assert len(set(runs[1][0])) > 3  # real text, not one token repeated


def test_int8_with_tensor_parallelism_still_answers(embedded_model_dir: Path) -> None:
    with LLM(embedded_model_dir, tensor_parallel_size=2, quantization="int8", max_model_len=256,
             kv_cache_memory_bytes=32 << 20, enforce_eager=True) as llm:  # fmt: skip
        [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0.0, max_tokens=16))  # fmt: skip
    assert "Paris" in out.text


def test_start_up_failure_raises_the_ranks_error_and_leaves_no_process(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="KV cache budget of 4096 bytes"):
        LLM(tiny_model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory_bytes=4096)
    assert multiprocessing.active_children() == []


def test_one_rank_failing_at_start_up_raises_that_ranks_error(tiny_model_factory) -> None:
    """6 query / 3 KV heads at tp 2: rank 0 holds 2 KV heads, rank 1 one. A budget that fits rank 1's share but
    not rank 0's fails rank 0 while rank 1 enters the block-count all-reduce; the caller gets rank 0's own
    error. (gloo fails rank 1's collective as soon as rank 0 exits; NCCL would leave it waiting, which is why
    the executor stops at the first start-up failure instead of waiting for every rank.)"""
    model_dir = tiny_model_factory("llama", num_heads=6, num_kv_heads=3, hidden_size=96, num_layers=2)
    per_token = {"rank 0": 2 * 2 * 2 * 16 * 4, "rank 1": 2 * 2 * 1 * 16 * 4}  # layers x K,V x heads x dim x fp32
    budget = 256 * (per_token["rank 0"] + per_token["rank 1"]) // 2  # max_model_len 256 fits only rank 1
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"KV cache budget of {budget} bytes"):
        LLM(model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory_bytes=budget)
    assert time.monotonic() - started < STRAGGLER_TIMEOUT_S
    assert multiprocessing.active_children() == []


def test_killed_worker_fails_the_next_step(tiny_model_dir: Path) -> None:
    llm = _tiny_llm(tiny_model_dir, 2)
    try:
        executor = llm.engine.executor
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        with pytest.raises(ExecutorDeadError, match=r"rank 1 .* was killed by signal 9"):
            llm.generate(["hello"], SamplingParams(max_tokens=4))
        with pytest.raises(ExecutorDeadError):  # and stays dead
            llm.engine.executor.execute_model(None)
    finally:
        llm.shutdown()
    assert multiprocessing.active_children() == []  # rank 0 was stopped too


async def test_worker_dying_while_idle_kills_the_async_engine(tiny_model_dir: Path) -> None:
    llm = _tiny_llm(tiny_model_dir, 2)
    engine = AsyncLLM.in_thread(llm.engine.core, llm.tokenizer)  # the server runs the same loop in a process
    await engine.start()
    try:
        async for _ in engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=2)):
            pass
        os.kill(llm.engine.executor.worker_pids[0], signal.SIGKILL)
        cause = await asyncio.wait_for(engine.wait_dead(), timeout=60)
        assert "ExecutorDeadError" in str(cause) and "rank 0" in str(cause)
        assert engine.errored
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("b", [1, 2, 3], SamplingParams(max_tokens=2)):
                pass
    finally:
        await engine.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.gpu
def test_tensor_parallel_on_two_gpus_matches_one(embedded_model_dir: Path) -> None:
    """NCCL and the Triton backend: bf16 sums split over two GPUs round differently from one, so the
    check is the first 8 greedy tokens of a real model (whose choices are far from ties) and the answer."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, {torch.cuda.device_count()} visible")
    prompts = ["The capital of France is", "def fibonacci(n):", "Kubernetes operators reconcile"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    runs = {}
    for tp_size in (1, 2):
        with LLM(embedded_model_dir, device="cuda", dtype="bfloat16", tensor_parallel_size=tp_size,
                 max_model_len=256, kv_cache_memory_bytes=256 << 20) as llm:  # fmt: skip
            runs[tp_size] = [o.output_token_ids for o in llm.generate(prompts, greedy)]
            if tp_size == 2:
                [chat] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                  SamplingParams(temperature=0.0, max_tokens=16))  # fmt: skip
                assert "Paris" in chat.text
    assert runs[2] == runs[1]
