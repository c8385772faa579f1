"""GPU check, part `step`: the engine's decode step time, eager against CUDA graphs, at batch 1, 8, 32 and 128.

For each model in the context (the embedded SmolLM2 shape, the 1B shape; random bf16 weights) a `LocalExecutor`
is built twice, with `enforce_eager=True` and with `enforce_eager=False` (CUDA graphs where the runner captures
them; whether it did is read off the runner and recorded). A scheduler stand-in prefills `batch` requests of a
few hundred tokens each, then times whole decode steps through `execute_model` (input preparation, forward,
LM head, sampler), the path a served request takes. Reported per batch: ms per step, generated tokens/s, and
the graphs' speed-up over eager. The record also carries the torch/triton versions and the device name.

Dry run (CPU): the embedded shape at batch 1 and 8 with a short context, eager only: it checks the driving code,
not the engine's speed.
"""

from __future__ import annotations

import importlib.metadata
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu.part import PartContext
from bench.gpu.shared import PAST_DEADLINE, embedded_first, failure_note, failure_record
from bench.step_driver import BLOCK_SIZE, DecodeDriver
from hpi_runtime.config import CacheConfig
from hpi_runtime.gpu_platform import default_attention_backend
from hpi_runtime.models.config import load_model_config
from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.model_runner import ModelRunner

MODES = {"eager": True, "graphs": False}  # mode -> enforce_eager


@dataclass(frozen=True)
class StepPlan:
    """What the part measures; the defaults are the GPU plan, a dry run replaces the sizes."""

    batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    context_tokens: int = 256  # each request's prompt: the context every timed decode step attends over
    warmup_steps: int = 5
    timed_steps: int = 30
    modes: tuple[str, ...] = tuple(MODES)
    # 4 GiB holds 128 requests of ~300 tokens of the 1B shape (32 KiB per token) with room to spare.
    kv_cache_bytes: int = 4 << 30
    prefill_tokens_per_step: int = 8192  # the prompts are prefilled in steps of about this many tokens
    dtype: torch.dtype = torch.bfloat16

    @property
    def max_model_len(self) -> int:
        return self.context_tokens + self.warmup_steps + self.timed_steps + 2 * BLOCK_SIZE


def plan_for(ctx: PartContext) -> StepPlan:
    if not ctx.dry_run:
        return StepPlan()
    # fp32: bf16 matmuls on a CPU without AMX take several times as long, and the dry run checks code, not speed.
    return StepPlan(batch_sizes=(1, 8), context_tokens=32, warmup_steps=1, timed_steps=4, modes=("eager",),
                    kv_cache_bytes=64 << 20, prefill_tokens_per_step=256, dtype=torch.float32)  # fmt: skip


def versions(device: torch.device) -> dict:
    """What produced the numbers: library versions and the device."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    on_cuda = device.type == "cuda"
    memory_bytes = torch.cuda.get_device_properties(device).total_memory if on_cuda else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
        "device_memory_gib": round(memory_bytes / 2**30, 1) if memory_bytes else None,
    }


def graph_state(runner: ModelRunner) -> dict:
    """Whether the runner captured CUDA graphs of the decode step, and for which batch sizes (a runner declines
    them for a model it cannot capture, and logs why)."""
    graphs = runner.graphs
    captured = graphs is not None and graphs.is_captured
    return {"captured": captured, "sizes": list(graphs.config.sizes) if captured else [],
            "is_compiled": runner.is_compiled}  # fmt: skip


def build_executor(model_dir: Path, ctx: PartContext, plan: StepPlan, enforce_eager: bool) -> LocalExecutor:
    config = ExecutorConfig(
        model_config=load_model_config(model_dir), dtype=plan.dtype, device=ctx.device,
        max_model_len=plan.max_model_len,
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=plan.kv_cache_bytes),
        attention_backend=default_attention_backend(ctx.device), enforce_eager=enforce_eager,
        max_num_seqs=max(plan.batch_sizes),  # every timed batch has a graph of its own size
    )  # fmt: skip
    return LocalExecutor(config)


def time_batch(executor: LocalExecutor, batch: int, plan: StepPlan, tag: str) -> dict:
    """Median ms of a decode step of `batch` requests, each `plan.context_tokens` deep."""
    driver = DecodeDriver(executor, batch, plan.context_tokens, tag, plan.prefill_tokens_per_step, seed=batch)
    driver.prefill()
    for _ in range(plan.warmup_steps):
        driver.decode()
    step_ms = []
    for _ in range(plan.timed_steps):
        # Wall clock per step is the device's time too: the sampled ids reach Python, so every step ends synced.
        start = time.perf_counter()
        driver.decode()
        step_ms.append(1000 * (time.perf_counter() - start))
    driver.finish()
    median_ms = statistics.median(step_ms)
    return {"step_ms": median_ms, "min_step_ms": min(step_ms), "decode_tok_s": batch * 1000 / median_ms}


def measure_mode(model_dir: Path, ctx: PartContext, plan: StepPlan, mode: str, deadline: float) -> tuple[dict, dict]:
    """One executor in `mode`: its start-up, graph state and each batch's step; returns (results, skipped)."""
    start = time.perf_counter()
    executor = build_executor(model_dir, ctx, plan, MODES[mode])
    result: dict = {
        "startup_s": time.perf_counter() - start,
        "startup_phases_s": dict(executor.startup),  # load, kv_cache, compile (where a capture would land), ...
        "graphs": graph_state(executor.runner),
        "batches": {},
    }
    skipped = {}
    try:
        for batch in plan.batch_sizes:
            if time.perf_counter() > deadline:
                skipped[f"batch {batch}"] = PAST_DEADLINE
                continue
            result["batches"][str(batch)] = time_batch(executor, batch, plan, f"{mode}-b{batch}")
    finally:
        executor.shutdown()
        del executor
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return result, skipped


def speedups(modes: dict) -> dict:
    """Per batch measured in both modes: eager ms / graphs ms."""
    eager, graphs = (modes.get(m, {}).get("batches", {}) for m in ("eager", "graphs"))
    return {b: eager[b]["step_ms"] / graphs[b]["step_ms"] for b in eager if b in graphs}


def run(ctx: PartContext) -> dict:
    deadline = ctx.deadline()
    plan = plan_for(ctx)
    skipped: dict[str, str] = {}
    if "graphs" not in plan.modes:
        skipped["graphs"] = "CUDA graphs need CUDA" if ctx.device.type != "cuda" else "not planned"
    models, errors, attempts = {}, [], 0
    for name, model_dir in embedded_first(ctx.models):
        modes = {}
        for mode in plan.modes:
            if time.perf_counter() > deadline:
                skipped[f"{name} {mode}"] = PAST_DEADLINE
                continue
            attempts += 1
            try:
                modes[mode], cut = measure_mode(Path(model_dir), ctx, plan, mode, deadline)
            except Exception as exc:  # a mode failing (a graph capture that crashed) keeps the other modes' numbers
                errors.append(exc)
                modes[mode], skipped[f"{name} {mode}"] = failure_record(exc), failure_note(exc)
                continue
            skipped.update({f"{name} {mode} {what}": why for what, why in cut.items()})
        models[name] = {**modes, "graphs_speedup": speedups(modes)}
    if errors and len(errors) == attempts:  # nothing measured: the part failed, with the first error's traceback
        raise errors[0]
    return {
        "headline": headline(models),
        "versions": versions(ctx.device),
        "dtype": str(plan.dtype).removeprefix("torch."),
        "context_tokens": plan.context_tokens,
        "timed_steps": plan.timed_steps,
        "models": models,
        "skipped": skipped,
    }


def headline(models: dict) -> list[str]:
    """One line per model and mode: ms per decode step by batch, and the graphs' speed-up."""
    lines = []
    for name, modes in models.items():
        for mode in MODES:
            batches = modes.get(mode, {}).get("batches", {})
            if batches:
                steps = ", ".join(f"b{b} {r['step_ms']:.2f}" for b, r in batches.items())
                lines.append(f"{name} {mode}: ms per decode step {steps}")
        if modes.get("graphs_speedup"):
            lines.append(f"{name} graphs speed-up: " + ", ".join(
                f"b{b} {x:.2f}x" for b, x in modes["graphs_speedup"].items()))  # fmt: skip
    return lines
