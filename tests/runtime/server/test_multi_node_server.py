"""One model across two hosts: `hpi serve` on a leader and on a worker host, each its own network stack (the worker
in a network namespace behind a veth pair, the same hostname: as LeaderWorkerSet pods may be), 2 pipeline stages
x 2 tensor-parallel ranks, gloo. It answers as one process does (greedy, fp32, concurrent requests, chunked
prefill, preemption); when a worker rank is killed mid-stream every in-flight request fails, the leader and the
worker host exit 1; the group started again serves again, and SIGTERM stops both with 0.

Where namespaces cannot be made (not root, no iproute2) the same test runs both hosts on loopback, so the logic
is tested on any machine; the skip of the namespace variant says why.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_testing.netns import TwoHosts, namespaces_unavailable, two_hosts
from hpi_testing.server import RuntimeServer, free_port, spawned_children

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "hello", "Paged attention keeps the keys and values of every request " * 2,
           "Kubernetes operators reconcile", "one two three four five six seven"]  # fmt: skip
MAX_TOKENS = 16
# 10 KV blocks in all (each rank holds its share of 4 layers x 2 KV heads): the five requests do not fit at once.
KV_BYTES = 160 << 10
FLAGS = ("--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "16", "--enforce-eager",
         "--kv-admission-watermark", "0", "--served-model-name", "tiny",
         "--distributed-timeout-seconds", "60")  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen2", num_layers=4, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[str]:
    with LLM(model_dir, dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory_bytes=KV_BYTES) as llm:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.text for o in llm.generate(PROMPTS, greedy)]


def _start_group(model_dir: Path, hosts: TwoHosts, logs: Path, tag: str) -> tuple[RuntimeServer, RuntimeServer]:
    group = ("-tp", "2", "-pp", "2", "--nnodes", "2", "--master-addr", hosts.here_addr,
             "--master-port", str(free_port()), "--kv-cache-memory", str(KV_BYTES // 4), *FLAGS)  # fmt: skip
    worker = RuntimeServer(model_dir, logs / f"worker-{tag}.log", *group, "--node-rank", "1", wait_ready=False,
                           host=hosts.there_addr, prefix=hosts.prefix)  # fmt: skip
    leader = RuntimeServer(model_dir, logs / f"leader-{tag}.log", *group, "--node-rank", "0", wait_ready=False)
    try:
        leader.wait_ready()
    except RuntimeError:
        worker.kill()
        raise RuntimeError(f"{leader.logs()}\n--- worker ---\n{worker.logs()}") from None
    return leader, worker


def _health(server: RuntimeServer) -> int:
    try:
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _complete(client: openai.OpenAI, prompt: str) -> str:
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    return out.choices[0].text


def _run_group(model_dir: Path, hosts: TwoHosts, tmp_path: Path, expected: list[str]) -> None:
    leader, worker = _start_group(model_dir, hosts, tmp_path, "first")
    try:
        deadline = time.monotonic() + 30  # the host sees its ranks loaded at its next heartbeat
        while _health(worker) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _health(worker) == 200, worker.logs()
        client = openai.OpenAI(base_url=f"{leader.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: several batches in the pipeline at once
            answers = list(pool.map(lambda p: _complete(client, p), PROMPTS))
        assert answers == expected
        samples = leader.metric_samples()
        assert samples["vllm:num_preemptions_total"] > 0  # the small KV cache preempted some

        ranks = spawned_children(worker.process.pid)
        assert len(ranks) == 2, worker.logs()
        outcomes: list[str] = []
        streaming = threading.Barrier(3 + 1)

        def stream() -> None:
            chunks = 0
            try:
                for _ in client.completions.create(model="tiny", prompt="Once", max_tokens=110, stream=True,
                                                   extra_body={"ignore_eos": True}):  # fmt: skip
                    chunks += 1
                    if chunks == 1:
                        streaming.wait(60)
                    time.sleep(0.05)  # a slow reader keeps the request in flight across the kill
                outcomes.append(f"whole ({chunks} chunks)")
            except Exception as exc:  # what the client sees when the server fails the request
                outcomes.append(f"{type(exc).__name__}: {exc}")

        readers = [threading.Thread(target=stream) for _ in range(3)]
        for reader in readers:
            reader.start()
        streaming.wait(60)
        os.kill(ranks[0], signal.SIGKILL)
        for reader in readers:
            reader.join(60)
        assert not any(r.is_alive() for r in readers), "a stream hung after the worker died"
        assert len(outcomes) == 3 and not any(o.startswith("whole") for o in outcomes), outcomes
        assert leader.process.wait(60) == 1, leader.logs()
        assert worker.process.wait(60) == 1, worker.logs()
        assert "pipeline rank 2 (stage 1, host 1) was killed by signal 9" in leader.logs(), leader.logs()
    finally:
        leader.stop()
        worker.stop()

    leader, worker = _start_group(model_dir, hosts, tmp_path, "again")  # what LeaderWorkerSet does next
    try:
        client = openai.OpenAI(base_url=f"{leader.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert _complete(client, PROMPTS[0]) == expected[0]
        assert leader.stop() == 0, leader.logs()
        assert worker.process.wait(60) == 0, worker.logs()  # the leader's shutdown stops the worker host's ranks
    finally:
        leader.stop()
        worker.stop()


def test_group_across_two_network_namespaces(model_dir: Path, expected: list[str], tmp_path: Path) -> None:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"{reason}; test_group_on_loopback covers the same logic")
    try:
        hosts = two_hosts()
        hosts_value = hosts.__enter__()
    except RuntimeError as exc:
        pytest.skip(f"cannot make a network namespace here ({exc}); test_group_on_loopback covers the same logic")
    try:
        _run_group(model_dir, hosts_value, tmp_path, expected)
    finally:
        hosts.__exit__(None, None, None)


def test_group_on_loopback(model_dir: Path, expected: list[str], tmp_path: Path) -> None:
    if namespaces_unavailable() is None:
        pytest.skip("network namespaces work here: test_group_across_two_network_namespaces runs instead")
    _run_group(model_dir, TwoHosts("127.0.0.1", "127.0.0.1", ()), tmp_path, expected)
