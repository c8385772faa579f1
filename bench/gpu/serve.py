"""GPU check, part `serve`: served throughput of `hpi serve` on the GPU against transformers' static batches.

For the embedded-shaped random model (then the 1B shape, when the budget still allows it): `hpi serve --device
cuda --dtype bfloat16` with room for 128 running requests answers closed loops of 1, 32 and 128 streaming clients
(bench/loadgen.py: fixed 128-token prompts and 128 output tokens, EOS ignored so every system generates the same
count). transformers `generate` then runs the same kind of prompts in one static batch of each size in a short
list, on the same GPU, in the same dtype. Reported per client count: output tokens/s, TTFT and inter-token
latency p50/p90, and hpi's output tokens/s over transformers' best static batch no larger than the client count
(bench/serving.py's `best_static_batch`).

Dry run (CPU): the embedded shape at 1 and 2 clients, a few short requests, `--enforce-eager` (no start-up
compile), transformers at batch 1 and 2, in fp32; tagged `dry_run`: the numbers mean nothing, the code path runs.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu.part import PartContext
from bench.gpu.shared import PAST_DEADLINE, embedded_first, failure_note, failure_record
from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.serving import best_static_batch
from bench.systems import SERVED_MODEL_NAME, ServerProcess, TransformersBaseline, hpi_command


@dataclass(frozen=True)
class ServePlan:
    """What the part measures; the defaults are the GPU plan, a dry run replaces the sizes."""

    clients: tuple[int, ...] = (1, 32, 128)  # closed-loop concurrencies
    tf_batch_sizes: tuple[int, ...] = (1, 32, 64, 128)
    prompt_len: int = 128
    output_len: int = 128
    requests_per_client: int = 2  # a closed loop of N clients sends max(min_requests, N * this) requests
    min_requests: int = 4
    dtype: str = "bfloat16"
    # 8 GiB of KV holds 128 requests of 256 tokens of the 1B shape (32 KiB a token) many times over, and allocates
    # in a moment where the default (85% of the free memory) would zero 100 GiB at start-up.
    server_args: tuple[str, ...] = ("--device", "cuda", "--max-num-seqs", "128", "--kv-cache-memory", "8GiB",
                                    "--max-model-len", "1024")  # fmt: skip
    # A second model starts only with this share of the part's budget left: a half-run model says less than none.
    next_model_budget_share: float = 0.45
    # hpi stops starting closed loops this share of the budget before the deadline: a ratio needs transformers too.
    transformers_budget_share: float = 0.2

    def num_requests(self, clients: int) -> int:
        return max(self.min_requests, clients * self.requests_per_client)


def plan_for(ctx: PartContext) -> ServePlan:
    if not ctx.dry_run:
        return ServePlan()
    return ServePlan(
        clients=(1, 2), tf_batch_sizes=(1, 2), prompt_len=16, output_len=8, requests_per_client=1, min_requests=2,
        dtype="float32",
        server_args=("--device", "cpu", "--enforce-eager", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
                     "--max-model-len", "256"),
    )  # fmt: skip


def workload(plan: ServePlan, num_requests: int, seed: int, output_len: int | None = None) -> WorkloadSpec:
    # A different seed per run: the prefix cache must not serve one run's prompts from an earlier run's blocks.
    return WorkloadSpec(num_requests, LengthDist(plan.prompt_len), LengthDist(output_len or plan.output_len), seed=seed)


def compact(summary: dict) -> dict:
    """The loadgen summary's headline numbers, with units in the key names."""
    return {
        "num_requests": summary["num_requests"],
        "num_errors": summary["num_errors"],
        "errors": summary["errors"],
        "duration_s": summary["duration_s"],
        "output_tok_s": summary["output_tokens_per_s"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "itl_p90_ms": summary["itl_ms"]["p90"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
    }


def _load(base_url: str, requests: list, clients: int) -> dict:
    return summarize(asyncio.run(run_load(requests, LoadConfig(base_url, SERVED_MODEL_NAME, concurrency=clients))))


def run_hpi(model_dir: Path, tokenizer, plan: ServePlan, log_dir: Path, deadline: float) -> tuple[dict, dict]:
    """Start `hpi serve` on `model_dir`, warm it up, run each closed loop; returns (results, cut)."""
    num_threads = max(1, min(8, os.cpu_count() or 1))
    command = hpi_command(num_threads, "--model", str(model_dir), "--dtype", plan.dtype, *plan.server_args)
    log_path = log_dir / f"hpi-{model_dir.name}.log"
    start = time.perf_counter()
    result: dict = {"command": list(command.argv[3:]), "clients": {}}
    cut = {}
    try:
        with ServerProcess(command, log_path, ready_timeout_s=240) as server:
            result["startup_s"] = time.perf_counter() - start
            # Warm-up at the widest batch: first-call costs (Triton JIT for new batch shapes) stay out of the runs.
            widest = max(plan.clients)
            _load(server.base_url, build_requests(tokenizer, workload(plan, widest, 99_999, 4)), widest)
            for clients in plan.clients:
                if time.perf_counter() > deadline:
                    cut[f"hpi {clients} clients"] = PAST_DEADLINE
                    continue
                requests = build_requests(tokenizer, workload(plan, plan.num_requests(clients), clients))
                result["clients"][str(clients)] = compact(_load(server.base_url, requests, clients))
    except RuntimeError as exc:  # the server did not come up or died: its log says why
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise RuntimeError(f"{exc}\n--- {log_path.name} (tail) ---\n{tail}") from exc
    return result, cut


def run_transformers(
    model_dir: Path, tokenizer, plan: ServePlan, device: torch.device, deadline: float
) -> tuple[dict, list[dict], dict[str, str]]:
    """transformers `generate`, one static batch of each size; returns (results, the runs as TransformersBaseline
    reports them, cut)."""
    start = time.perf_counter()
    baseline = TransformersBaseline(model_dir, getattr(torch, plan.dtype), device)
    result: dict = {"load_s": time.perf_counter() - start, "batches": {}}
    runs, cut = [], {}
    try:
        for batch_size in plan.tf_batch_sizes:
            if time.perf_counter() > deadline:
                cut[f"transformers batch {batch_size}"] = PAST_DEADLINE
                continue
            requests = build_requests(tokenizer, workload(plan, batch_size, 50_000 + batch_size))
            prompt_ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
            run = baseline.run(prompt_ids, plan.output_len, batch_size)
            runs.append(run)
            result["batches"][str(batch_size)] = {
                "output_tok_s": run["output_tokens_per_s"], "duration_s": run["duration_s"],
                "ttft_p50_ms": run["ttft_ms"]["p50"], "tpot_p50_ms": run["tpot_ms"]["p50"],
            }  # fmt: skip
    finally:
        del baseline
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result, runs, cut


def ratios(hpi: dict, tf_runs: list[dict]) -> dict:
    """Per client count: hpi's output tok/s over transformers' best static batch no larger than it."""
    rows = {}
    for clients, measured in hpi["clients"].items():
        best = best_static_batch(tf_runs, int(clients))
        if best is None:
            continue
        rows[clients] = {
            "hpi_output_tok_s": measured["output_tok_s"],
            "tf_output_tok_s": best["output_tokens_per_s"],
            "tf_batch_size": best["batch_size"],
            "hpi_over_tf": measured["output_tok_s"] / best["output_tokens_per_s"],
        }
    return rows


def serve_model(
    model_dir: Path, ctx: PartContext, plan: ServePlan, log_dir: Path, deadline: float
) -> tuple[dict, dict[str, str]]:
    """hpi, then transformers, on one model; returns (results, cut)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hpi, cut = run_hpi(model_dir, tokenizer, plan, log_dir, deadline - plan.transformers_budget_share * ctx.budget_s)
    tf, tf_runs, tf_cut = run_transformers(model_dir, tokenizer, plan, ctx.device, deadline)
    return {"hpi": hpi, "transformers": tf, "ratios": ratios(hpi, tf_runs)}, {**cut, **tf_cut}


def run(ctx: PartContext) -> dict:
    start = time.perf_counter()
    deadline = ctx.deadline()
    plan = plan_for(ctx)
    skipped: dict[str, str] = {}
    if ctx.dry_run:
        skipped["gpu workload"] = ("the dry run serves 1 and 2 clients a few short requests on CPU in fp32; "
                                   "32 and 128 clients of 128 + 128 tokens in bf16 need CUDA")  # fmt: skip
    if "1b" not in ctx.models:
        skipped["1b"] = "no 1B model in this run"
    models, errors = {}, []
    with tempfile.TemporaryDirectory(prefix="hpi-gpu-serve-") as log_dir:  # logs travel only inside errors
        for i, (name, model_dir) in enumerate(embedded_first(ctx.models)):
            left_s = deadline - time.perf_counter()
            if i and left_s < plan.next_model_budget_share * ctx.budget_s:
                skipped[name] = f"cut: {left_s:.0f} s of the part's budget left, a model needs more"
                continue
            try:
                models[name], cut = serve_model(Path(model_dir), ctx, plan, Path(log_dir), deadline)
            except Exception as exc:  # one model failing (a server that died, an OOM) keeps the other's numbers
                errors.append(exc)
                models[name], skipped[name] = failure_record(exc), failure_note(exc)
                continue
            skipped.update({f"{name} {what}": why for what, why in cut.items()})
    if errors and len(errors) == len(models):  # nothing measured: the part failed, with the first error's traceback
        raise errors[0]
    return {
        "headline": headline(models),
        "dry_run": ctx.dry_run,
        "workload": {"prompt_tokens": plan.prompt_len, "output_tokens": plan.output_len, "dtype": plan.dtype,
                     "clients": list(plan.clients), "tf_batch_sizes": list(plan.tf_batch_sizes)},  # fmt: skip
        "models": models,
        "elapsed_s": time.perf_counter() - start,
        "skipped": skipped,
    }


def headline(models: dict) -> list[str]:
    """Per model and client count: hpi's output tok/s and its ratio to transformers' best static batch."""
    lines = []
    for name, result in models.items():
        cells = [f"{c} client{'' if c == '1' else 's'} {r['hpi_output_tok_s']:.0f} tok/s = "
                 f"{r['hpi_over_tf']:.2f}x transformers (batch {r['tf_batch_size']})"
                 for c, r in result.get("ratios", {}).items()]  # fmt: skip
        if cells:
            lines.append(f"{name}: " + "; ".join(cells))
    return lines
