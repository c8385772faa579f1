"""Async load generator for any OpenAI-compatible server (`/v1/completions`, streamed).

A request set is built once from a seed (prompt and output lengths drawn from chosen distributions, prompt
texts made of whole words so that they re-tokenize to exactly the drawn length), then replayed either
closed loop (N clients, each sends its next request when the previous one finishes) or open loop
(arrivals at a Poisson rate, whatever the server's state). Output lengths are forced with `max_tokens`
plus `ignore_eos` (hpi, vLLM) and `min_tokens` (llama-cpp-python), so every system generates the same count.

    .venv/bin/python -m bench.loadgen --base-url http://127.0.0.1:8000 --concurrency 8 --num-requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass(frozen=True)
class LengthDist:
    """Token counts: `fixed` always `mean`; `uniform` in [mean*(1-spread), mean*(1+spread)]."""

    mean: int
    kind: str = "fixed"
    spread: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":
            lo, hi = max(1, round(self.mean * (1 - self.spread))), max(1, round(self.mean * (1 + self.spread)))
            return rng.randint(lo, hi)
        raise ValueError(f"unknown length distribution {self.kind!r} (fixed, uniform)")


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    shared_prefix_len: int = 0  # tokens of one system prompt that every request starts with


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    model: str | None = None  # the 'model' to ask for (a LoRA adapter's name); None: LoadConfig.model


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    model: str
    concurrency: int | None = None  # closed loop: this many clients
    rate_rps: float | None = None  # open loop: Poisson arrivals at this rate
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_rps is None):
            raise ValueError("set exactly one of concurrency (closed loop) and rate_rps (open loop)")


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    start_s: float  # since the run began
    e2e_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()  # gaps between streamed chunks after the first
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RunResult:
    config: LoadConfig
    duration_s: float
    results: tuple[RequestResult, ...] = field(repr=False)


class PromptBuilder:
    """Texts of an exact token count for one tokenizer, from whole-word vocabulary entries (' word')."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        words = []
        for token, token_id in tokenizer.get_vocab().items():
            if token.startswith("\u0120") and token[1:].isalpha() and token[1:].islower() and 3 <= len(token) <= 9:
                words.append((token_id, " " + token[1:]))
        self.words = sorted(words)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, num_tokens: int, rng: random.Random) -> str:
        text = "".join(rng.choice(self.words)[1] for _ in range(num_tokens))
        for _ in range(8):  # a few words may merge or split; trim or pad until the count is exact
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                return text
            if len(ids) > num_tokens:
                text = self.tokenizer.decode(ids[:num_tokens])
            else:
                text += "".join(rng.choice(self.words)[1] for _ in range(num_tokens - len(ids)))
        raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")


def build_requests(tokenizer, spec: WorkloadSpec) -> list[RequestSpec]:
    """The request set for `spec`: the same texts and lengths for every system under test."""
    rng = random.Random(spec.seed)
    builder = PromptBuilder(tokenizer)
    prefix = builder.text(spec.shared_prefix_len, rng) if spec.shared_prefix_len else ""
    requests = []
    for _ in range(spec.num_requests):
        num_unique = spec.prompt_len.sample(rng)
        prompt = prefix + builder.text(num_unique, rng)
        requests.append(RequestSpec(prompt, builder.count(prompt), spec.output_len.sample(rng)))
    return requests


def request_body(model: str, request: RequestSpec) -> dict:
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "ignore_eos": True,  # hpi, vLLM
        "min_tokens": request.max_tokens,  # llama-cpp-python (masks EOS until min_tokens)
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# A pooled keep-alive connection the server closed as the request was being written (llama-server's HTTP library
# closes a connection after a few requests): sent again, on a connection of its own, before any response, as the
# openai client does (2 retries by default). The wait stays in the timings.
CONNECT_ERRORS = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)
CONNECT_RETRIES = 2


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, chunk_times: list, state: dict) -> str | None:
    """POST `body` and read its stream into chunk_times and state (usage, finish_reason; "responded" once the
    status line came back); an HTTP error's message, or None."""
    async with session.post(url, json=body) as r:
        state["responded"] = True
        if r.status != 200:
            return f"HTTP {r.status}: {(await r.text())[:200]}"
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                state["usage"] = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    chunk_times.append(time.perf_counter())
                state["finish_reason"] = choice.get("finish_reason") or state.get("finish_reason")
    return None


async def send_one(session: aiohttp.ClientSession, config: LoadConfig, request: RequestSpec, t0: float):
    start = time.perf_counter()
    chunk_times: list[float] = []
    state: dict = {}
    body, url = request_body(request.model or config.model, request), f"{config.base_url}/v1/completions"
    for attempt in range(1 + CONNECT_RETRIES):
        state["responded"] = False
        try:
            if attempt == 0:
                error = await _stream(session, url, body, chunk_times, state)
            else:  # not another pooled connection: it may be closed as well
                connector = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(timeout=session.timeout, connector=connector) as fresh:
                    error = await _stream(fresh, url, body, chunk_times, state)
            if error is not None:
                return RequestResult(False, start - t0, time.perf_counter() - start, error=error)
            break
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            if isinstance(exc, CONNECT_ERRORS) and not state["responded"] and attempt < CONNECT_RETRIES:
                continue
            return RequestResult(False, start - t0, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    usage, finish_reason = state.get("usage"), state.get("finish_reason")
    end = time.perf_counter()
    if not chunk_times:
        return RequestResult(False, start - t0, end - start, error="no tokens streamed")
    if usage and usage.get("completion_tokens"):
        num_output = usage["completion_tokens"]
    elif finish_reason == "length":
        num_output = request.max_tokens
    else:
        num_output = len(chunk_times)
    if num_output != request.max_tokens:
        return RequestResult(False, start - t0, end - start, error=f"{num_output} tokens, wanted {request.max_tokens}")
    return RequestResult(
        ok=True,
        start_s=start - t0,
        e2e_s=end - start,
        ttft_s=chunk_times[0] - start,
        itl_s=tuple(b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)),
        num_prompt_tokens=(usage or {}).get("prompt_tokens", request.num_prompt_tokens),
        num_output_tokens=num_output,
    )


async def run_load(requests: Sequence[RequestSpec], config: LoadConfig) -> RunResult:
    """Replay `requests` closed loop (config.concurrency) or open loop (config.rate_rps)."""
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        if config.concurrency is not None:
            queue = list(reversed(requests))
            results: list[RequestResult] = []

            async def client() -> None:
                while queue:
                    results.append(await send_one(session, config, queue.pop(), t0))

            await asyncio.gather(*(client() for _ in range(config.concurrency)))
        else:
            rng = random.Random(config.seed)
            tasks, next_s = [], 0.0
            for request in requests:
                delay = next_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send_one(session, config, request, t0)))
                next_s += rng.expovariate(config.rate_rps)
            results = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - t0
    return RunResult(config, duration_s, tuple(results))


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank-interpolated percentiles, in milliseconds for seconds input."""
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    out = {}
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        out[f"p{q}"] = 1000 * (ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


def summarize(run: RunResult) -> dict:
    """Throughput, latency percentiles (ms) and errors of one run; raw samples kept for CDF plots."""
    ok = [r for r in run.results if r.ok]
    num_output = sum(r.num_output_tokens for r in ok)
    itl = [gap for r in ok for gap in r.itl_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    return {
        "mode": "closed" if run.config.concurrency is not None else "open",
        "concurrency": run.config.concurrency,
        "rate_rps": run.config.rate_rps,
        "num_requests": len(run.results),
        "num_errors": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if r.error})[:5],
        "duration_s": run.duration_s,
        "requests_per_s": len(ok) / run.duration_s,
        "output_tokens_per_s": num_output / run.duration_s,
        "total_tokens_per_s": (num_output + sum(r.num_prompt_tokens for r in ok)) / run.duration_s,
        "mean_prompt_tokens": sum(r.num_prompt_tokens for r in ok) / max(1, len(ok)),
        "mean_output_tokens": num_output / max(1, len(ok)),
        "ttft_ms": percentiles([r.ttft_s for r in ok]),
        "itl_ms": percentiles(itl),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
        "samples": {
            "ttft_s": [round(r.ttft_s, 5) for r in ok],
            "e2e_s": [round(r.e2e_s, 5) for r in ok],
            "tpot_s": [round(t, 6) for t in tpot],
        },
    }


def main() -> None:
    from transformers import AutoTokenizer

    from hpi_runtime.model_source import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", default=None, help="model directory; default: the embedded model")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int)
    mode.add_argument("--rate", type=float, help="requests/s, Poisson arrivals")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--length-dist", default="fixed", choices=["fixed", "uniform"])
    parser.add_argument("--spread", type=float, default=0.5, help="for --length-dist uniform")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir, _ = resolve_model_dir(args.tokenizer)
    spec = WorkloadSpec(
        args.num_requests,
        LengthDist(args.prompt_len, args.length_dist, args.spread),
        LengthDist(args.output_len, args.length_dist, args.spread),
        args.seed,
    )
    requests = build_requests(AutoTokenizer.from_pretrained(model_dir), spec)
    config = LoadConfig(args.base_url, args.model, args.concurrency, args.rate, args.seed)
    summary = summarize(asyncio.run(run_load(requests, config)))
    summary.pop("samples")
    print(json.dumps({"workload": asdict(spec), **summary}, indent=2))


if __name__ == "__main__":
    main()
