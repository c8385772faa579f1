"""What structured outputs cost a served batch: 32 concurrent chat requests, unconstrained, all under a JSON
schema, and half and half, on one `hpi serve` of the embedded model (the same run, the same prompts, every
request exactly max_tokens long).

Each phase reports output tokens/s over the phase and, per request class, the decode rate a client sees
(output tokens / (e2e - TTFT)) and TTFT, from streamed responses. Constrained requests pay the per-step
bitmask fill and mask; in the mixed phase the unconstrained ones should decode as fast as in the first.
The phases run twice, in opposite orders (A B C C B A), so that a drift in the machine's load shows.

A second measurement, `--offline`, runs the same three batches in this process (the offline engine, one
thread) and times each decode step in CPU time of the stepping thread, which a machine shared with other
work disturbs far less than wall time: the grammar's cost per step, without the HTTP path.

    .venv/bin/python -m bench.bench_structured_outputs            # writes bench/results/structured_outputs.json
    .venv/bin/python -m bench.bench_structured_outputs --offline  # writes structured_outputs_offline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import aiohttp

from bench.report import machine_description
from bench.systems import REPO_ROOT, SERVED_MODEL_NAME, ServerProcess, hpi_command

# Realistic JSON (nested objects, bounded strings, ranged integers) that cannot be complete before max_tokens:
# every request, constrained or not, then emits exactly max_tokens tokens, so the phases compare like for like.
SCHEMA = {"type": "object", "properties": {"readings": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "temperature_c"], "additionalProperties": False}}},
    "required": ["readings"], "additionalProperties": False}
TOPICS = ["a painter", "a sailor", "a chemist", "a baker", "a pilot", "a poet", "a farmer", "a judge"]


async def one_request(session: aiohttp.ClientSession, url: str, index: int, constrained: bool,
                      max_tokens: int) -> dict:
    body = {"model": SERVED_MODEL_NAME, "max_tokens": max_tokens, "temperature": 0.7, "seed": index,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "messages": [{"role": "user", "content": "List temperature readings of cities as JSON, as "
                          f"{TOPICS[index % len(TOPICS)]} would report them (report {index})."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    start = time.perf_counter()
    first = None
    tokens = 0
    text = ""
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text += choice["delta"]["content"]
    end = time.perf_counter()
    # Cut off by max_tokens, constrained output is a valid JSON prefix: it starts as the schema says.
    valid = text.startswith('{"readings": [{"city": "') if constrained else None
    return {"constrained": constrained, "tokens": tokens, "ttft_s": (first or end) - start,
            "decode_tok_s": (tokens - 1) / max(end - (first or end), 1e-9), "valid_json": valid}


async def phase(url: str, constrained: list[bool], max_tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(session, url, i, c, max_tokens)
                                         for i, c in enumerate(constrained)))
        wall_s = time.perf_counter() - start
    summary = {"num_requests": len(results), "wall_s": round(wall_s, 2),
               "output_tok_s": round(sum(r["tokens"] for r in results) / wall_s, 1)}
    for name, flag in (("constrained", True), ("unconstrained", False)):
        rows = [r for r in results if r["constrained"] == flag]
        if rows:
            summary[name] = {"num": len(rows), "mean_tokens": round(statistics.mean(r["tokens"] for r in rows), 1),
                             "decode_tok_s_p50": round(statistics.median(r["decode_tok_s"] for r in rows), 2),
                             "ttft_s_p50": round(statistics.median(r["ttft_s"] for r in rows), 2)}
            if flag:
                summary[name]["schema_prefix_ok"] = sum(bool(r["valid_json"]) for r in rows)
    return summary


def offline(args: argparse.Namespace) -> dict:
    import torch

    from hpi_runtime.llm import LLM
    from hpi_runtime.sampling_params import SamplingParams
    from hpi_runtime.structured.params import StructuredOutputsParams

    torch.set_num_threads(1)  # all the work in the thread whose CPU time is measured
    llm = LLM(dtype="float32", kv_cache_memory_bytes=1 << 30, max_num_seqs=args.concurrency,
              enforce_eager="--enforce-eager" in args.hpi_args)
    engine, tokenizer = llm.engine, llm.tokenizer
    structured = StructuredOutputsParams.json_schema(SCHEMA)
    phases = {}
    order = [("unconstrained", [False] * args.concurrency), ("constrained", [True] * args.concurrency),
             ("mixed", [i % 2 == 0 for i in range(args.concurrency)])]
    for round_index, names in enumerate((order, order[::-1])):
        for name, flags in names:
            for i, constrained in enumerate(flags):
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": f"List temperature readings as JSON (report {round_index}-{i})."}],
                    add_generation_prompt=True, tokenize=False)
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i, ignore_eos=True,
                                        structured_outputs=structured if constrained else None)
                engine.add_request(f"{name}-{round_index}-{i}", tokenizer(text).input_ids, params)
            step_cpu_s = []
            while engine.has_unfinished_requests():
                start = time.thread_time()
                engine.step()
                step_cpu_s.append(time.thread_time() - start)
            decode = step_cpu_s[2:-1]  # the prefill step(s) and the last, draining one left out
            result = {"decode_step_cpu_ms_p50": round(statistics.median(decode) * 1e3, 2),
                      "decode_tok_per_cpu_s": round(len(flags) / statistics.median(decode), 1)}
            phases.setdefault(name, []).append(result)
            print(f"offline round {round_index + 1} {name}", json.dumps(result), flush=True)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP threads of the server")
    parser.add_argument("--hpi-args", default="", help="extra `hpi serve` arguments, e.g. '--enforce-eager'")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--offline", action="store_true", help="in-process engine, CPU time per decode step")
    args = parser.parse_args()
    if args.offline:
        results = {"machine": machine_description(), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                   "threads": 1, "phases": offline(args)}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured_outputs_offline.json").write_text(json.dumps(results, indent=1) + "\n")
        return
    n = args.concurrency
    extra = ["--max-num-seqs", str(n), "--kv-cache-memory", "1GiB", *args.hpi_args.split()]
    phases = {}
    with ServerProcess(hpi_command(args.threads, *extra), args.out / "logs" / "hpi-structured.log") as server:
        asyncio.run(phase(server.base_url, [True, False], 8))  # warm-up: the schema is compiled and cached
        order = [("unconstrained", [False] * n), ("constrained", [True] * n),
                 ("mixed", [i % 2 == 0 for i in range(n)])]
        for round_index, names in enumerate((order, order[::-1])):
            for name, flags in names:
                result = asyncio.run(phase(server.base_url, flags, args.max_tokens))
                phases.setdefault(name, []).append(result)
                print(f"round {round_index + 1} {name}", json.dumps(result), flush=True)
    results = {"machine": machine_description(), "concurrency": n, "max_tokens": args.max_tokens,
               "hpi_args": args.hpi_args, "phases": phases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_outputs.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
