"""Serving benchmark: hpi against transformers `generate` and llama.cpp, same machine, same requests.

For each concurrency N, a closed loop of N clients replays a seeded request set (fixed prompt and output
lengths, EOS ignored) against `hpi serve`, then against llama.cpp: its own C++ `llama-server` with `--parallel N`
on the F16 GGUF made from the checkpoint hpi serves (`make llama-cpp` builds both), or, where that was not
built, llama-cpp-python's server (one sequence at a time) on the GGUF the embedded model was converted from.
transformers runs offline on the same prompts with static batches, in hpi's dtype and in fp32 where that
differs; its row at concurrency N is its best batch size <= N, and the baseline of the ratios is the faster of
its dtypes. One system runs at a time; with several rounds the order alternates and the ratios are the median.
An open-loop run (Poisson arrivals at a fraction of hpi's measured capacity) shows latency under a load that
does not wait for it.

    .venv/bin/python -m bench.serving --concurrency 1 8 32 --output-len 32     # a smaller sweep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.llamacpp_build import built, server_command
from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.systems import (
    SERVED_MODEL_NAME,
    ServerProcess,
    TransformersBaseline,
    hpi_command,
    llamacpp_command,
    metric_value,
)

SYSTEMS = ("hpi", "llama.cpp", "transformers", "transformers-fp32", "hpi-offline")


@dataclass(frozen=True)
class ServingPlan:
    concurrencies: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    llama_concurrencies: tuple[int, ...] = (1, 4, 32)  # llama-cpp-python: one sequence at a time, flat after N=1
    # llama.cpp's C++ server batches: it runs at every N of `concurrencies` (a server with --parallel N for each)
    tf_batch_sizes: tuple[int, ...] = (1, 8, 16, 32, 64)
    prompt_len: int = 128
    output_len: int = 128
    requests_per_client: float = 2.0  # closed loop: N * this requests (at least min_requests)
    min_requests: int = 4
    llama_max_requests: int = 32
    open_loop_load: float = 0.7  # Poisson rate as a fraction of hpi's best closed-loop requests/s
    open_loop_requests: int = 48
    num_threads: int = 2
    kv_cache_memory: str = "1GiB"
    seed: int = 0
    hpi_args: tuple[str, ...] = ()  # more `hpi serve` flags, e.g. ("--quantization", "int4")


def workload(plan: ServingPlan, num_requests: int, seed_offset: int) -> WorkloadSpec:
    # A different seed per run: hpi's prefix cache must not serve a later run from an earlier one's prompts.
    return WorkloadSpec(num_requests, LengthDist(plan.prompt_len), LengthDist(plan.output_len),
                        seed=plan.seed * 100_000 + seed_offset)


def num_requests_for(plan: ServingPlan, concurrency: int, cap: int | None = None) -> int:
    n = max(plan.min_requests, round(concurrency * plan.requests_per_client), concurrency)
    return min(n, max(cap, concurrency)) if cap else n


def _warm_up(base_url: str, tokenizer, plan: ServingPlan) -> None:
    requests = build_requests(tokenizer, WorkloadSpec(2, LengthDist(plan.prompt_len), LengthDist(8), seed=99_999))
    asyncio.run(run_load(requests, LoadConfig(base_url, SERVED_MODEL_NAME, concurrency=2)))


def _closed_loop(server: ServerProcess, tokenizer, plan: ServingPlan, concurrency: int, cap: int | None) -> dict:
    requests = build_requests(tokenizer, workload(plan, num_requests_for(plan, concurrency, cap), concurrency))
    run = asyncio.run(run_load(requests, LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=concurrency)))
    return summarize(run)


def run_hpi(plan: ServingPlan, tokenizer, log_dir: Path, progress) -> dict:
    runs, open_loop = [], None
    command = hpi_command(plan.num_threads, "--kv-cache-memory", plan.kv_cache_memory,
                          "--max-num-seqs", str(max(64, *plan.concurrencies)), *plan.hpi_args)
    with ServerProcess(command, log_dir / "hpi.log") as server:
        _warm_up(server.base_url, tokenizer, plan)
        for concurrency in plan.concurrencies:
            before = server.metrics_text()
            summary = _closed_loop(server, tokenizer, plan, concurrency, None)
            after = server.metrics_text()
            summary["num_preemptions"] = metric_value(after, "vllm:num_preemptions_total") - metric_value(
                before, "vllm:num_preemptions_total")
            runs.append(summary)
            progress(f"hpi N={concurrency}: {summary['output_tokens_per_s']:.1f} out tok/s")
        if plan.open_loop_load > 0 and plan.open_loop_requests > 0:
            rate = plan.open_loop_load * max(r["requests_per_s"] for r in runs)
            requests = build_requests(tokenizer, workload(plan, plan.open_loop_requests, 77_777))
            config = LoadConfig(server.base_url, SERVED_MODEL_NAME, rate_rps=rate, seed=plan.seed)
            open_loop = summarize(asyncio.run(run_load(requests, config)))
            progress(f"hpi open loop {rate:.2f} req/s: TTFT p50 {open_loop['ttft_ms']['p50']:.0f} ms")
    return {"closed_loop": runs, "open_loop": open_loop, "command": list(command.argv[1:])}


def run_llamacpp(plan: ServingPlan, tokenizer, log_dir: Path, progress) -> dict:
    if built("F16"):
        return _run_llama_server(plan, tokenizer, log_dir, progress)
    runs = []
    command = llamacpp_command(plan.num_threads)
    with ServerProcess(command, log_dir / "llamacpp.log") as server:
        _warm_up(server.base_url, tokenizer, plan)
        for concurrency in plan.llama_concurrencies:
            summary = _closed_loop(server, tokenizer, plan, concurrency, plan.llama_max_requests)
            runs.append(summary)
            progress(f"llama-cpp-python N={concurrency}: {summary['output_tokens_per_s']:.1f} out tok/s")
    return {"closed_loop": runs, "server": "llama-cpp-python", "command": list(command.argv[1:])}


def _run_llama_server(plan: ServingPlan, tokenizer, log_dir: Path, progress) -> dict:
    """llama.cpp's C++ server, restarted with `--parallel N` for each N (its best setting for N clients)."""
    runs, command = [], None
    for concurrency in plan.concurrencies:
        command = server_command("F16", concurrency, plan.prompt_len + plan.output_len + 64, plan.num_threads)
        with ServerProcess(command, log_dir / f"llama-server-{concurrency}.log") as server:
            _warm_up(server.base_url, tokenizer, plan)
            runs.append(_closed_loop(server, tokenizer, plan, concurrency, None))
        progress(f"llama-server F16 N={concurrency}: {runs[-1]['output_tokens_per_s']:.1f} out tok/s")
    return {"closed_loop": runs, "server": "llama-server F16 (C++, --parallel N)",
            "command": list(command.argv[1:]) if command else []}


def run_transformers(plan: ServingPlan, tokenizer, model_dir: Path, dtype: torch.dtype, progress) -> dict:
    baseline = TransformersBaseline(model_dir, dtype)
    runs = []
    for batch_size in plan.tf_batch_sizes:
        requests = build_requests(tokenizer, workload(plan, batch_size, 50_000 + batch_size))
        prompt_ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
        result = baseline.run(prompt_ids, plan.output_len, batch_size)
        runs.append(result)
        progress(f"transformers batch={batch_size}: {result['output_tokens_per_s']:.1f} out tok/s")
    return {"static_batches": runs, "dtype": str(dtype).removeprefix("torch.")}


def run_hpi_offline(plan: ServingPlan, tokenizer, progress) -> dict:
    """hpi's offline `LLM.generate` (no HTTP, no second process) on the requests of each closed-loop run, with
    max_num_seqs = N: what the server would reach if serving cost nothing. Same dtype (auto) and KV size."""
    from hpi_runtime.llm import LLM
    from hpi_runtime.options import parse_bytes
    from hpi_runtime.sampling_params import SamplingParams

    runs = []
    for concurrency in plan.concurrencies:
        requests = build_requests(tokenizer, workload(plan, num_requests_for(plan, concurrency, None), concurrency))
        prompt_ids = [tokenizer(r.prompt).input_ids for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        with LLM(kv_cache_memory_bytes=parse_bytes(plan.kv_cache_memory), max_num_seqs=concurrency) as llm:
            llm.generate([prompt_ids[0]], SamplingParams(max_tokens=4, temperature=0.0))  # first-call costs
            start = time.perf_counter()
            outputs = llm.generate(prompt_ids, params)
            duration_s = time.perf_counter() - start
        num_output = sum(len(o.output_token_ids) for o in outputs)
        runs.append({"concurrency": concurrency, "num_requests": len(requests), "duration_s": duration_s,
                     "output_tokens_per_s": num_output / duration_s})
        progress(f"hpi offline max_num_seqs={concurrency}: {num_output / duration_s:.1f} out tok/s")
    return {"runs": runs}


def best_static_batch(tf_runs: list[dict], concurrency: int) -> dict | None:
    """transformers' best run among batch sizes <= concurrency (a static batch cannot exceed the clients)."""
    fitting = [r for r in tf_runs if r["batch_size"] <= concurrency]
    return max(fitting, key=lambda r: r["output_tokens_per_s"], default=None)


def ratio_rows(results: dict) -> list[dict]:
    """Per hpi concurrency: output tok/s of hpi, transformers' best static batch <= N (in hpi's dtype, in fp32,
    and the faster of the two: the baseline at its best on this machine), llama.cpp at N (or its nearest
    measured N below, where llama-cpp-python serves one sequence at a time), and hpi's ratios."""
    tf_runs = (results.get("transformers") or {}).get("static_batches", [])
    tf32_runs = (results.get("transformers-fp32") or {}).get("static_batches", [])
    tf_dtype = (results.get("transformers") or {}).get("dtype")
    llama_runs = (results.get("llama.cpp") or {}).get("closed_loop", [])
    offline = {r["concurrency"]: r for r in (results.get("hpi-offline") or {}).get("runs", [])}
    rows = []
    for run in results["hpi"]["closed_loop"]:
        n, hpi_tps = run["concurrency"], run["output_tokens_per_s"]
        tf, tf32 = best_static_batch(tf_runs, n), best_static_batch(tf32_runs, n)
        best = max((r for r in (tf, tf32) if r), key=lambda r: r["output_tokens_per_s"], default=None)
        best_dtype = None if best is None else ("float32" if best is tf32 else tf_dtype)
        llama = max((r for r in llama_runs if r["concurrency"] <= n), key=lambda r: r["concurrency"], default=None)
        rows.append({
            "concurrency": n,
            "hpi_tok_s": hpi_tps,
            "tf_tok_s": tf and tf["output_tokens_per_s"],
            "tf_batch_size": tf and tf["batch_size"],
            "llama_tok_s": llama and llama["output_tokens_per_s"],
            "llama_concurrency": llama and llama["concurrency"],
            "hpi_over_tf": tf and hpi_tps / tf["output_tokens_per_s"],
            "tf_fp32_tok_s": tf32 and tf32["output_tokens_per_s"],
            "hpi_over_tf_fp32": tf32 and hpi_tps / tf32["output_tokens_per_s"],
            "tf_best_tok_s": best and best["output_tokens_per_s"],
            "tf_best_batch_size": best and best["batch_size"],
            "tf_best_dtype": best_dtype,
            "hpi_over_tf_best": best and hpi_tps / best["output_tokens_per_s"],
            "hpi_over_llama": llama and hpi_tps / llama["output_tokens_per_s"],
            "offline_tok_s": offline[n]["output_tokens_per_s"] if n in offline else None,
            "hpi_over_offline": hpi_tps / offline[n]["output_tokens_per_s"] if n in offline else None,
        })
    return rows


def median_ratios(rounds: list[dict]) -> list[dict]:
    """Per concurrency, the median over rounds of every rate and ratio (each round's own rows stay in the
    JSON): a ratio from one round compares systems run minutes apart, the median of rounds in alternating
    order cancels most of a shared machine's drift. Labels (batch sizes, dtypes) are the first round's."""
    by_concurrency: dict[int, list[dict]] = {}
    for results in rounds:
        for row in results.get("ratios", []):
            by_concurrency.setdefault(row["concurrency"], []).append(row)
    merged = []
    for _, rows in sorted(by_concurrency.items()):
        row = {**rows[0], "rounds": len(rows)}
        for key, value in rows[0].items():
            if key != "concurrency" and isinstance(value, float):
                values = [r[key] for r in rows if isinstance(r.get(key), float)]
                row[key] = statistics.median(values)
        merged.append(row)
    return merged


def run_rounds(plan: ServingPlan, model_dir: Path, dtype: torch.dtype, log_dir: Path, progress,
               systems: tuple[str, ...], rounds: int) -> dict:
    """`rounds` runs of the systems, every other one in reverse order; with one round, that round's results."""
    results = []
    for r in range(rounds):
        order = systems if r % 2 == 0 else tuple(reversed(systems))
        results.append(run_serving(plan, model_dir, dtype, log_dir, lambda m, r=r: progress(f"round {r + 1}: {m}"),
                                   order))
    if rounds == 1:
        return results[0]
    return {"plan": results[0]["plan"], "rounds": results, "ratios": median_ratios(results)}


def run_serving(plan: ServingPlan, model_dir: Path, dtype: torch.dtype, log_dir: Path, progress=print,
                systems: tuple[str, ...] = ("hpi", "llama.cpp", "transformers")) -> dict:
    """The systems one at a time, in the order given (run_rounds alternates it), and hpi's ratios."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runners = {
        "hpi": lambda: run_hpi(plan, tokenizer, log_dir, progress),
        "llama.cpp": lambda: run_llamacpp(plan, tokenizer, log_dir, progress),
        "transformers": lambda: run_transformers(plan, tokenizer, model_dir, dtype, progress),
        "transformers-fp32": lambda: run_transformers(plan, tokenizer, model_dir, torch.float32, progress),
        "hpi-offline": lambda: run_hpi_offline(plan, tokenizer, progress),
    }
    unknown = set(systems) - set(runners)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {sorted(runners)}")
    results: dict = {"plan": asdict(plan), "order": list(systems)}
    for system in systems:
        if system == "transformers-fp32" and dtype == torch.float32:
            continue  # "transformers" is fp32 already
        try:
            results[system] = runners[system]()
        except (FileNotFoundError, RuntimeError) as exc:
            if system != "llama.cpp":
                raise
            results[system] = {"skipped": str(exc)}
            progress(f"llama.cpp skipped: {exc}")
    if "hpi" in results:
        results["ratios"] = ratio_rows(results)
    return results


def main() -> None:
    from hpi_runtime.engine_factory import resolve_dtype
    from hpi_runtime.model_source import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(ServingPlan.concurrencies))
    parser.add_argument("--llama-concurrency", type=int, nargs="+", default=list(ServingPlan.llama_concurrencies))
    parser.add_argument("--tf-batch-sizes", type=int, nargs="+", default=list(ServingPlan.tf_batch_sizes))
    parser.add_argument("--prompt-len", type=int, default=ServingPlan.prompt_len)
    parser.add_argument("--output-len", type=int, default=ServingPlan.output_len)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                        help="any of hpi, llama.cpp, transformers (in hpi's dtype), transformers-fp32 (in fp32 as "
                             "well where hpi's dtype is not), hpi-offline (LLM.generate on the same requests)")
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--rounds", type=int, default=2,
                        help="run the systems this many times, every other round in reverse order, so that a "
                             "shared machine's drift lands on all alike; ratios per round and the median")  # fmt: skip
    args = parser.parse_args()
    plan = ServingPlan(concurrencies=tuple(args.concurrency), llama_concurrencies=tuple(args.llama_concurrency),
                       tf_batch_sizes=tuple(args.tf_batch_sizes), prompt_len=args.prompt_len,
                       output_len=args.output_len)
    model_dir, _ = resolve_model_dir(None)
    dtype = resolve_dtype("auto", torch.device("cpu"), "float32")
    results = run_rounds(plan, model_dir, dtype, Path("bench/results/tmp"), print, tuple(args.systems), args.rounds)
    for row in results.get("ratios", []):
        print(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
