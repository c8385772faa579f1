"""`hpi serve --kv-offload-bytes`: multi-turn chat through the real `openai` client against a server whose KV
cache holds two or three conversations, with the host tier's gain visible on /metrics (hits by tier, blocks and
bytes moved, preemptions by mode) and counted in vLLM's own prefix-cache counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from hpi_testing.server import RuntimeServer
from hpi_testing.server import post_json as post

BLOCK_BYTES = 16 * 512  # the tiny model in fp32, 16-token blocks


@pytest.fixture(scope="module")
def offload_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("offload") / "server.log"
    with RuntimeServer(tiny_model_dir, log, "--served-model-name", "tiny", "--dtype", "float32",
                       "--kv-cache-memory", str(36 * BLOCK_BYTES), "--kv-offload-bytes", "2MiB",
                       "--max-model-len", "512", "--kv-admission-watermark", "0") as running:  # fmt: skip
        yield running


async def _chat(client: openai.AsyncOpenAI, conversation: int, num_turns: int) -> list[str]:
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 2}]
    replies = []
    for turn in range(num_turns):
        messages.append({"role": "user", "content": f"conversation {conversation}, turn {turn}: one two three"})
        response = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        reply = response.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def test_multi_turn_chat_reuses_offloaded_prefixes(offload_server: RuntimeServer) -> None:
    before = offload_server.metric_samples()
    assert before["hpi:kv_host_cache_bytes"] == 2 * 2**20 // BLOCK_BYTES * BLOCK_BYTES
    assert before["hpi:kv_host_cache_blocks"] == 2 * 2**20 // BLOCK_BYTES
    for name in ('hpi:prefix_cache_hits_by_tier_total{tier=host}', 'hpi:kv_blocks_transferred_total{direction=to_host}',
                 'hpi:kv_bytes_transferred_total{direction=to_device}', 'hpi:preemptions_by_mode_total{mode=swap}',
                 "hpi:prefill_tokens_computed_total", "hpi:kv_host_cache_usage_perc"):  # fmt: skip
        assert name in before, name

    async def run() -> list[list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{offload_server.base_url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(_chat(client, c, 3) for c in range(8)))

    conversations = asyncio.run(run())
    assert all(len(replies) == 3 and all(replies) for replies in conversations)
    after = offload_server.metric_samples()
    host_hits = after["hpi:prefix_cache_hits_by_tier_total{tier=host}"]
    device_hits = after["hpi:prefix_cache_hits_by_tier_total{tier=device}"]
    assert host_hits > 0, "no conversation came back from the host tier"
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == host_hits + device_hits
    offloaded = after["hpi:kv_blocks_transferred_total{direction=to_host}"]
    loaded = after["hpi:kv_blocks_transferred_total{direction=to_device}"]
    assert offloaded > 0 and loaded > 0
    assert after["hpi:kv_bytes_transferred_total{direction=to_device}"] == loaded * BLOCK_BYTES
    assert after["hpi:kv_host_cache_cached_blocks"] > 0
    assert after["hpi:prefill_tokens_computed_total"] < after["vllm:prompt_tokens_total"]
    preemptions = after["vllm:num_preemptions_total"]
    assert preemptions == (after["hpi:preemptions_by_mode_total{mode=swap}"]
                           + after["hpi:preemptions_by_mode_total{mode=recompute}"])  # fmt: skip


def test_the_host_tier_outlives_a_level_1_sleep(offload_server: RuntimeServer) -> None:
    """Sleep frees the device KV cache and forgets its hashes, but the host tier keeps its blocks: a conversation
    replayed after waking finds its prefix there and gets the same greedy replies."""

    async def run(conversations: range) -> list[list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{offload_server.base_url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(_chat(client, c, 3) for c in conversations))

    first = asyncio.run(run(range(8)))[0]  # enough conversations to push the first one's blocks to the host
    cached = offload_server.metric_samples()["hpi:kv_host_cache_cached_blocks"]
    assert cached > 0
    status, slept = post(offload_server.base_url, "/sleep?level=1", b"")
    assert status == 200 and slept["freed_bytes"] == 36 * BLOCK_BYTES, slept  # the device pool, not the tier
    asleep = offload_server.metric_samples()
    assert asleep["hpi:kv_host_cache_cached_blocks"] == cached
    assert post(offload_server.base_url, "/wake_up", b"")[0] == 200
    host_hits = asleep["hpi:prefix_cache_hits_by_tier_total{tier=host}"]
    assert asyncio.run(run(range(1)))[0] == first
    assert offload_server.metric_samples()["hpi:prefix_cache_hits_by_tier_total{tier=host}"] > host_hits
