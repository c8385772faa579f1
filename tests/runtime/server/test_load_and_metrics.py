"""Many concurrent streams with disconnecting clients; /metrics under the vLLM contract names."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
import pytest

from hpi_contracts.metrics import READ_BY_OPERATOR, STARTUP_PHASE_SECONDS, STARTUP_SECONDS
from hpi_testing.server import RuntimeServer, metric_samples, post_json

VLLM_CONTRACT = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
]


@pytest.fixture(scope="module")
def busy_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("busy") / "server.log"
    # A small KV cache so that 120 streams force preemptions as well; speculative decoding on at any batch size,
    # so that drafts are verified, rolled back and preempted under that load too.
    speculative = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1000}'
    with RuntimeServer(tiny_model_dir, log, "--served-model-name", "tiny-llama", "--max-num-seqs", "48",
                       "--kv-cache-memory", "1MiB", "--max-model-len", "256",
                       "--speculative-config", speculative) as running:  # fmt: skip
        yield running


def wait_for_idle(server, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = server.metric_samples()
        idle = (values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
                and values["vllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def metric_names(values: dict[str, float]) -> set[str]:
    return {name.split("{")[0] for name in values}


def test_metrics_export_the_contract_before_any_request(busy_server) -> None:
    values = busy_server.metric_samples()
    names = metric_names(values)
    for name in VLLM_CONTRACT:  # histograms too: a query over their buckets must not go missing
        assert name in names, name
    for name in READ_BY_OPERATOR:
        assert any(n == name or n.startswith(name + "_") for n in names), f"operator reads {name}"
    assert values["hpi:kv_cache_blocks"] > 0 and values["hpi:model_weight_bytes"] > 0
    [cache_config] = [name for name in values if name.startswith("vllm:cache_config_info{")]
    labels = dict(pair.split("=") for pair in cache_config.split("{")[1].rstrip("}").split(","))
    assert labels["num_gpu_blocks"] == str(int(values["hpi:kv_cache_blocks"])) and labels["cache_dtype"] == "auto"
    assert labels["block_size"] == "16" and labels["num_cpu_blocks"] == "0" and values[cache_config] == 1
    # Start-up, phase by phase (hpi_runtime/startup.py): the engine core's phases came through CoreInfo.
    phases = {name.split("phase=")[1].rstrip("}"): v for name, v in values.items()
              if name.startswith(STARTUP_PHASE_SECONDS + "{")}  # fmt: skip
    assert {"imports", "prepare", "core_process", "load", "layout", "kv_cache", "compile", "warm_up"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values()) and phases["load"] > 0 and phases["warm_up"] > 0
    [total] = [v for name, v in values.items() if name.split("{")[0] == STARTUP_SECONDS]
    assert total >= sum(phases.values()) * 0.99  # the phases lie within the process's life


def test_a_finished_request_observes_its_mean_time_per_output_token_once(busy_server) -> None:
    """Also its prompt and generated token counts, once each (vllm:request_prompt_tokens, _generation_tokens)."""
    tpot, e2e, ttft = ("vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                       "vllm:time_to_first_token_seconds")  # fmt: skip
    prompt, generation = "vllm:request_prompt_tokens", "vllm:request_generation_tokens"
    before = wait_for_idle(busy_server)
    prompt_tokens = 0
    for max_tokens in (6, 1):  # one token has no gap to average: no sample for the second request
        body = {"model": "tiny-llama", "prompt": "one two three", "max_tokens": max_tokens, "ignore_eos": True}
        status, answer = post_json(busy_server.base_url, "/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == max_tokens, answer
        prompt_tokens += answer["usage"]["prompt_tokens"]
    after = wait_for_idle(busy_server)
    grew = {name: after[name] - before[name] for name in (f"{tpot}_count", f"{tpot}_sum", f"{e2e}_sum", f"{ttft}_sum",
                                                          f"{e2e}_count", f"{prompt}_count", f"{prompt}_sum",
                                                          f"{generation}_count", f"{generation}_sum")}  # fmt: skip
    assert grew[f"{tpot}_count"] == 1 and grew[f"{e2e}_count"] == 2
    assert (grew[f"{prompt}_count"], grew[f"{prompt}_sum"]) == (2, prompt_tokens)
    assert (grew[f"{generation}_count"], grew[f"{generation}_sum"]) == (2, 7)
    # (e2e - TTFT) / 5 for the six-token request: at most the time both requests spent after their first token.
    assert 0 < grew[f"{tpot}_sum"] * 5 <= grew[f"{e2e}_sum"] - grew[f"{ttft}_sum"] + 1e-6


def test_concurrent_streams_with_disconnects(busy_server) -> None:
    rng = random.Random(0)
    plans = [(i, rng.random() < 0.3) for i in range(120)]

    async def one(session: aiohttp.ClientSession, i: int, disconnect: bool) -> tuple[str, int, str | None]:
        body = {"model": "tiny-llama", "prompt": f"request {i}: one two three", "max_tokens": 24 + i % 16,
                "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
        async with session.post(f"{busy_server.base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                return "status", response.status, await response.text()
            finish, chunks = None, 0
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunks += 1
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                finish = payload["choices"][0]["finish_reason"] or finish
                if disconnect and chunks == 3:
                    response.close()  # the client goes away mid-stream
                    return "disconnected", 200, None
            return "done", 200, finish

    async def watch(done: asyncio.Event) -> list[tuple[float, float]]:
        """Scrape /metrics while the streams run until the engine is seen busy (or the load is over)."""
        seen = []
        async with aiohttp.ClientSession() as session:  # its own connections: the streams use up a pool's 100
            while not done.is_set():
                async with session.get(f"{busy_server.base_url}/metrics") as response:
                    values = metric_samples(await response.text())
                seen.append((values["vllm:num_requests_running"], values["vllm:kv_cache_usage_perc"]))
                if seen[-1] != (0, 0):
                    break
                await asyncio.sleep(0.05)
        return seen

    async def run() -> tuple[list, list]:
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            results = await asyncio.gather(*(one(session, i, d) for i, d in plans))
        done.set()
        return results, await watcher

    before = busy_server.metric_samples()
    results, scrapes = asyncio.run(run())
    assert any(running > 0 or kv_usage > 0 for running, kv_usage in scrapes), f"/metrics missed the load: {scrapes}"
    statuses = [r[1] for r in results]
    assert all(s < 500 for s in statuses), [r for r in results if r[1] >= 500]
    for (i, disconnect), (kind, status, finish) in zip(plans, results, strict=True):
        assert status == 200, (i, kind, finish)
        if not disconnect:
            assert (kind, finish) == ("done", "length"), i

    after = wait_for_idle(busy_server)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    # Speculative decoding's counters, as vLLM's: drafts were verified, some accepted, per position summing up.
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"]
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert 0 < accepted < after["vllm:spec_decode_num_draft_tokens_total"]
    per_position = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(3)]
    assert sum(per_position) == accepted and per_position[0] >= per_position[2]
    assert after["vllm:kv_cache_usage_perc"] == 0  # aborted streams left no blocks behind
    # Every request ends once: the survivors by length; a disconnected one by abort, or by length when the engine
    # finished it before the abort reached it (a race the client cannot close: 4 of 25 did on a CI run).
    survivors = sum(1 for _, d in plans if not d)
    ended = {reason: after[f"vllm:request_success_total{{finished_reason={reason}}}"]
             - before.get(f"vllm:request_success_total{{finished_reason={reason}}}", 0)
             for reason in ("length", "abort")}  # fmt: skip
    assert ended["length"] + ended["abort"] == len(plans), ended
    assert survivors <= ended["length"] and ended["abort"] > 0, ended
    assert after["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:time_to_first_token_seconds_count"] >= survivors
    assert after["vllm:e2e_request_latency_seconds_count"] >= survivors
    for name in ("vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count"):
        assert after[name] - before[name] >= survivors, name
    assert metric_names(after) >= set(VLLM_CONTRACT)
    assert busy_server.process.poll() is None
