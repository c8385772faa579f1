"""Where one decode step's time goes: linears, attention, element-wise ops, host-side preparation.

Drives one LocalExecutor per mode (eager, compiled, compiled with frozen weights, compiled with the fp32
linear weights column-major for MKL (use_sgemm_layout) instead of the C++ kernel's packed panels
(pack_cpu_weights), or row-major as loaded) on the embedded
SmolLM2 directly with hand-made scheduler deltas: N requests with P-token prompts are prefilled one by one, then
decode together. The modes take turns step by step; the median of S decode steps is timed per mode, and
the medians of a few more steps profiled with torch.profiler give the components (ms):
- linears: self time of the matmul ops inside the model forward (the LM head is counted under logits);
- attention: the attention op (the C++ kernel's or hpi::paged_attention) or, eagerly, all of Attention.forward;
- elementwise: the rest of the model forward (norms, activations, rotary, residuals, dispatch);
- logits + sampling: the LM head over the sampled rows and the sampler;
- host prep: the rest of the step (scheduler deltas, flat inputs, attention metadata, sampling settings).

    .venv/bin/python bench/profile_model_step.py --dtype float32 --batch 32   # eager, compiled, frozen
    .venv/bin/python bench/profile_model_step.py --modes eager               # an engine without compilation
    .venv/bin/python bench/profile_model_step.py --dtype float32 bfloat16 --modes compiled sgemm
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
import unittest.mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.step_driver import BLOCK_SIZE, DecodeDriver
from hpi_runtime.config import CacheConfig
from hpi_runtime.embedded import ensure_embedded_model
from hpi_runtime.models.config import load_model_config
from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.sampler import Sampler

LINEAR_OPS = {"aten::mm", "aten::addmm", "hpi_kernels::packed_linear",
              "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
              "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::_mkl_linear"}  # fmt: skip
ATTENTION_OPS = {"hpi::paged_attention", "hpi_kernels::cached_paged_attention_cpu"}


def _traced(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def _components(prof, step_ms: float) -> dict[str, float]:
    events = prof.events()
    totals: dict[str, float] = {}
    linear_ms = attention_op_ms = 0.0
    for event in events:
        if event.name in ("model", "attention", "logits", "sampler"):
            totals[event.name] = totals.get(event.name, 0.0) + event.cpu_time_total / 1e3
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if "model" not in ancestors:
            continue
        if event.name in LINEAR_OPS:
            linear_ms += event.self_cpu_time_total / 1e3
        if event.name in ATTENTION_OPS and "attention" not in ancestors:
            attention_op_ms += event.cpu_time_total / 1e3
    model_ms = totals.get("model", 0.0)
    attention_ms = totals.get("attention", 0.0) + attention_op_ms
    logits_ms = totals.get("logits", 0.0) + totals.get("sampler", 0.0)
    return {
        "linears": linear_ms,
        "attention": attention_ms,
        "elementwise": model_ms - linear_ms - attention_ms,
        "logits + sampling": logits_ms,
        "host prep": step_ms - model_ms - logits_ms,
        "step": step_ms,
    }


MODES = {  # ExecutorConfig settings of each mode
    "eager": {"enforce_eager": True},
    "compiled": {"enforce_eager": False, "freeze_weights": False},
    "frozen": {"enforce_eager": False, "freeze_weights": True},
    "sgemm": {"enforce_eager": False, "freeze_weights": False},  # compiled, fp32 column-major for MKL, bf16 oneDNN
    "row-major": {"enforce_eager": False, "freeze_weights": False},  # compiled, linear weights as loaded
}
UNPACKED_LAYOUTS = {  # what the executor's fp32 CPU weight layout functions do in these modes
    "sgemm": {"pack_cpu_weights": lambda model: 0},
    "row-major": {"pack_cpu_weights": lambda model: 0, "use_sgemm_layout": lambda model: 0},
}


def _executor(mode: str, dtype: torch.dtype) -> LocalExecutor:
    settings = dict(model_config=load_model_config(ensure_embedded_model()), dtype=dtype, device=torch.device("cpu"),
                    max_model_len=2048,
                    cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=512 << 20))  # fmt: skip
    if "enforce_eager" in {f.name for f in dataclasses.fields(ExecutorConfig)}:
        settings.update(MODES[mode])
    elif mode != "eager":
        raise SystemExit("this engine predates compilation: --modes eager only")
    start = time.perf_counter()
    with contextlib.ExitStack() as patches:
        for name, replacement in UNPACKED_LAYOUTS.get(mode, {}).items():
            patches.enter_context(unittest.mock.patch(f"hpi_runtime.worker.executor.{name}", replacement))
        executor = LocalExecutor(ExecutorConfig(**settings))
    print(f"{mode}: executor ready in {time.perf_counter() - start:.1f} s", flush=True)
    runner = executor.runner
    if getattr(runner, "is_compiled", False):  # wrap outside the compiled region: Dynamo never sees it
        runner._forward = _traced("model", runner._forward)
    else:  # instances only: a patched class could change what a compiled model in this process traces
        runner.model.forward = _traced("model", runner.model.forward)
        for attn in runner.model.attention_layers():
            attn.forward = _traced("attention", attn.forward)
    runner.model.compute_logits = _traced("logits", runner.model.compute_logits)
    return executor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="one or more: each mode runs in each dtype, all taking turns")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per mode")
    parser.add_argument("--profiled-steps", type=int, default=5, help="profiled decode steps per mode")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=list(MODES))
    args = parser.parse_args()
    Sampler.__call__ = _traced("sampler", Sampler.__call__)
    drivers = {}
    for mode in args.modes:
        for dtype in args.dtype:
            name = mode if len(args.dtype) == 1 else f"{mode} {dtype}"
            drivers[name] = DecodeDriver(_executor(mode, getattr(torch, dtype)), args.batch, args.prompt_len)
            drivers[name].prefill()
    # Modes take turns step by step, so whatever else the machine does lands on all of them alike.
    times: dict[str, list[float]] = {mode: [] for mode in drivers}
    for _ in range(args.steps):
        for mode, driver in drivers.items():
            start = time.perf_counter()
            driver.decode()
            times[mode].append((time.perf_counter() - start) * 1e3)
    parts: dict[str, list[dict[str, float]]] = {mode: [] for mode in drivers}
    for _ in range(args.profiled_steps):
        for mode, driver in drivers.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                driver.decode()
                step_ms = (time.perf_counter() - start) * 1e3
            parts[mode].append(_components(prof, step_ms))
    print(f"{' / '.join(args.dtype)}, batch {args.batch}, context {args.prompt_len}..{args.prompt_len + args.steps}")
    for mode in drivers:
        median_ms = statistics.median(times[mode])
        components = {k: statistics.median(p[k] for p in parts[mode]) for k in parts[mode][0]}
        print(f"{mode:>16}: decode step {median_ms:.1f} ms ({args.batch * 1e3 / median_ms:.0f} tok/s); profiled (ms) "
              + ", ".join(f"{k} {v:.1f}" for k, v in components.items()))  # fmt: skip


if __name__ == "__main__":
    main()
