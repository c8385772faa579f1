"""The host KV tier on multi-turn chat: `hpi serve` with `--kv-offload-bytes` against the same server without
it, on the same conversations, in one run.

Every conversation is a closed-loop client: each turn resends the whole history (its earlier user turns and
the model's answers, as text) plus a new user turn, streamed through /v1/completions. All conversations are
active at once and the device KV pool is sized to hold about `pool_fraction` of their final histories, so
without the tier most of a returning conversation's prefix has been evicted and is recomputed; with it, the
evicted blocks come back from host memory. Reported per run: TTFT p50/p90 (all turns, and turns after the
first), prompt tokens the model computed (`hpi:prefill_tokens_computed`), the prefix-cache hit rate and its
split by tier, preemptions by mode, blocks and bytes moved; and the ratios off/on.

    .venv/bin/python -m bench.bench_kv_offload                        # 64 conversations x 6 turns
    .venv/bin/python -m bench.bench_kv_offload --think-time-s 10      # users pause ~10 s between turns
    .venv/bin/python -m bench.bench_kv_offload --conversations 16 --turns 4 --out bench/results/tmp/kv.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import PromptBuilder, percentiles
from bench.systems import SERVED_MODEL_NAME, ServerProcess, hpi_command


@dataclass(frozen=True)
class ChatPlan:
    conversations: int = 64
    turns: int = 6
    user_tokens: int = 64  # each new user turn
    answer_tokens: int = 32  # each model answer
    pool_fraction: float = 0.25  # of all conversations' final histories that the device KV pool holds
    offload_gib: float = 4.0  # the host tier, when on
    # Mean seconds a user takes before the next turn (exponential, seeded): 0 sends it at once, which keeps
    # every conversation queued and makes TTFT mostly queueing behind decode; chat users pause between turns.
    think_time_s: float = 0.0
    num_threads: int = 2
    dtype: str = "float32"
    seed: int = 0

    @property
    def final_prompt_tokens(self) -> int:
        return self.turns * self.user_tokens + (self.turns - 1) * self.answer_tokens


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)


async def _turn(session: aiohttp.ClientSession, base_url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}  # fmt: skip
    start = time.perf_counter()
    ttft, pieces = None, []
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            text = json.loads(line[5:])["choices"][0].get("text") or ""
            if text and ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(text)
    return ttft, "".join(pieces)


async def _conversation(
    session, base_url: str, user_turns: list[str], answer_tokens: int, think_s: list[float]
) -> list[float]:
    history, ttfts = "", []
    for user, pause_s in zip(user_turns, think_s, strict=True):
        await asyncio.sleep(pause_s)
        history += user
        ttft, answer = await _turn(session, base_url, history, answer_tokens)
        ttfts.append(ttft)
        history += answer
    return ttfts


def _think_times(plan: ChatPlan) -> list[list[float]]:
    """Per conversation, the pause before each turn (the first turns start staggered over one mean pause)."""
    rng = random.Random(plan.seed + 1)
    if plan.think_time_s <= 0:
        return [[0.0] * plan.turns for _ in range(plan.conversations)]
    mean = plan.think_time_s
    return [[rng.uniform(0, mean)] + [rng.expovariate(1 / mean) for _ in range(plan.turns - 1)]
            for _ in range(plan.conversations)]  # fmt: skip


def _user_turns(plan: ChatPlan, tokenizer) -> list[list[str]]:
    rng = random.Random(plan.seed)
    builder = PromptBuilder(tokenizer)
    return [[builder.text(plan.user_tokens, rng) for _ in range(plan.turns)] for _ in range(plan.conversations)]


def _counters(metrics: str) -> dict[str, float]:
    """The run's counters from a /metrics text, label order aside."""
    wanted = {
        "prompt_tokens": ("vllm:prompt_tokens_total", {}),
        "prefill_computed": ("hpi:prefill_tokens_computed_total", {}),
        "queries": ("vllm:prefix_cache_queries_total", {}),
        "hits": ("vllm:prefix_cache_hits_total", {}),
        "host_hits": ("hpi:prefix_cache_hits_by_tier_total", {"tier": "host"}),
        "preemptions": ("vllm:num_preemptions_total", {}),
        "swaps": ("hpi:preemptions_by_mode_total", {"mode": "swap"}),
        "blocks_to_host": ("hpi:kv_blocks_transferred_total", {"direction": "to_host"}),
        "blocks_to_device": ("hpi:kv_blocks_transferred_total", {"direction": "to_device"}),
        "bytes_moved_to_device": ("hpi:kv_bytes_transferred_total", {"direction": "to_device"}),
    }
    samples = [sample for family in text_string_to_metric_families(metrics) for sample in family.samples]
    return {
        key: sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())
        for key, (name, labels) in wanted.items()
    }


def run_chat(plan: ChatPlan, user_turns: list[list[str]], kv_bytes: int, offload: bool, log_dir: Path) -> dict:
    args = ["--dtype", plan.dtype, "--kv-cache-memory", str(kv_bytes), "--max-model-len",
            str(plan.final_prompt_tokens + plan.answer_tokens + 64)]  # fmt: skip
    if offload:
        args += ["--kv-offload-bytes", f"{plan.offload_gib}GiB"]
    log = log_dir / f"hpi-kv-offload-{'on' if offload else 'off'}.log"
    with ServerProcess(hpi_command(plan.num_threads, *args), log) as server:

        async def drive() -> list[list[float]]:
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
                await _turn(session, server.base_url, "warm up the server with a first request", 4)
                return await asyncio.gather(*(
                    _conversation(session, server.base_url, turns, plan.answer_tokens, think_s)
                    for turns, think_s in zip(user_turns, _think_times(plan), strict=True)
                ))  # fmt: skip

        before = _counters(server.metrics_text())
        start = time.perf_counter()
        ttfts = asyncio.run(drive())
        duration_s = time.perf_counter() - start
        after = _counters(server.metrics_text())
    counts = {key: after[key] - before[key] for key in after}
    return {
        "offload": offload,
        "duration_s": duration_s,
        "ttft_ms": percentiles([t for conversation in ttfts for t in conversation], (50, 90)),
        "ttft_later_turns_ms": percentiles([t for conversation in ttfts for t in conversation[1:]], (50, 90)),
        "prefix_hit_rate": counts["hits"] / counts["queries"] if counts["queries"] else 0.0,
        "host_hit_share": counts["host_hits"] / counts["hits"] if counts["hits"] else 0.0,
        **{key: int(value) for key, value in counts.items()},
    }


def run_kv_offload(plan: ChatPlan, log_dir: Path, progress=print) -> dict:
    from transformers import AutoTokenizer

    from hpi_runtime.model_source import resolve_model_dir

    model_dir, _ = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    user_turns = _user_turns(plan, tokenizer)
    token_bytes = kv_bytes_per_token(model_dir, plan.dtype)
    pool_tokens = max(int(plan.conversations * plan.final_prompt_tokens * plan.pool_fraction),
                      plan.final_prompt_tokens + plan.answer_tokens + 64)  # fmt: skip
    kv_bytes = pool_tokens * token_bytes
    progress(f"device KV pool: {pool_tokens} tokens ({kv_bytes / 2**20:.0f} MiB) for {plan.conversations} "
             f"conversations of up to {plan.final_prompt_tokens} prompt tokens")  # fmt: skip
    runs = {}
    for offload in (False, True):
        runs["on" if offload else "off"] = result = run_chat(plan, user_turns, kv_bytes, offload, log_dir)
        progress(f"tier {'on' if offload else 'off'}: TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
                 f"prompt tokens computed {result['prefill_computed']}, hit rate {result['prefix_hit_rate']:.2f}")
    off, on = runs["off"], runs["on"]
    return {
        "plan": asdict(plan),
        "machine": {"cpu": platform.processor() or platform.machine(), "isa": cpu_isa()},
        "device_pool_tokens": pool_tokens,
        **runs,
        "ratios_off_over_on": {
            "prompt_tokens_computed": off["prefill_computed"] / max(on["prefill_computed"], 1),
            "ttft_p50": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
            "ttft_p90": off["ttft_ms"]["p90"] / on["ttft_ms"]["p90"],
            "ttft_later_turns_p50": off["ttft_later_turns_ms"]["p50"] / on["ttft_later_turns_ms"]["p50"],
            "duration": off["duration_s"] / on["duration_s"],
        },
    }


def cpu_isa() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "no avx2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in asdict(ChatPlan()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_offload.json"))
    args = vars(parser.parse_args())
    out = args.pop("out")
    result = run_kv_offload(ChatPlan(**args), Path("bench/results/logs"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratios_off_over_on"], indent=1))


if __name__ == "__main__":
    main()
