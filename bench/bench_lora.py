"""Multi-LoRA serving: 8 adapters on one base model against the base model alone and against the same 8
adapters merged into 8 models served by 8 engines, on the same machine, in one run.

Adapters: rank 16 on all seven projections (q, k, v, o, gate, up, down) of the embedded SmolLM2-135M-Instruct,
built with `peft` (random A and B). `hpi serve --enable-lora --max-loras 4`: 8 adapters through 4 slots, so
adapters are swapped in and out while the load runs. Load: a closed loop of `concurrency` streaming clients,
requests spread evenly over the 8 adapter names (the base run sends the same requests to the base model).
Merged: each adapter merged into the base weights (peft `merge_and_unload`), one `hpi serve` per merged model, all
8 up at once, each given concurrency / 8 clients, an eighth of the requests and an eighth of the threads (at least
one: with 2 threads each, 16 OpenMP threads on 2 cores mostly waited for each other, run 18), at their default
step (the DecodeStack, as the LoRA server's). Memory: the resident set of each server and its engine-core process,
summed.
The slots' bound (phase base_bound): the base model alone at the LoRA server's running batch, concurrency x
max_loras / num_adapters clients (a request runs only with its adapter in a slot). Phase lora_bf16_slots: the LoRA
server with `--lora-dtype bfloat16` (under an fp32 model, where the CPU lacks fast bf16: half the adapters' bytes).
Also: the decode step time of 16 and 32 requests whose requests use 0, 1, 2 or 4 distinct adapters
(in-process), the LoRA step (C++ kernel; decode steps in the C++ DecodeStack, as the base model's) and the eager
one with torch ops against the base model, the engines taking turns step by step.

    .venv/bin/python -m bench.bench_lora
    .venv/bin/python -m bench.bench_lora --num-requests 64 --output-len 32 --out bench/results/tmp/lora.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.report import machine_description
from bench.systems import SERVED_MODEL_NAME, ServerProcess, cache_dir, hpi_command, metric_value
from hpi_contracts.metrics import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAPlan:
    num_adapters: int = 8
    rank: int = 16
    max_loras: int = 4
    max_cpu_loras: int | None = None  # --max-cpu-loras (host-memory copies); None: the server's default (max_loras)
    concurrency: int = 32
    num_requests: int = 128
    prompt_len: int = 64
    output_len: int = 64
    num_threads: int = 2
    kv_cache_memory: str = "512MiB"
    merged_kv_cache_memory: str = "256MiB"  # per merged engine: 4 clients each
    merged_max_model_len: int = 1024  # so that its smaller KV budget holds one whole request
    step_batch: int = 32  # the engines' max_num_seqs
    step_batches: tuple[int, ...] = (16, 32)
    step_distinct: tuple[int, ...] = (0, 1, 2, 4)
    num_timed_steps: int = 16
    seed: int = 0


def build_adapters(base_dir: Path, plan: LoRAPlan, root: Path) -> list[Path]:
    """`num_adapters` PEFT directories (random A and B, small enough to keep the text sensible), built once."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    paths = [root / f"adapter{i}" for i in range(plan.num_adapters)]
    for i, path in enumerate(paths):
        if (path / "adapter_model.safetensors").exists():
            continue
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(r=plan.rank, lora_alpha=2 * plan.rank, target_modules=list(PROJECTIONS))
        model = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(plan.seed * 1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        model.save_pretrained(path)
    return paths


def merge_adapters(base_dir: Path, adapters: list[Path], root: Path) -> list[Path]:
    """Each adapter merged into a copy of the base model (weights + tokenizer files), built once."""
    import torch
    import transformers
    from peft import PeftModel

    merged = []
    for adapter in adapters:
        out = root / f"merged-{adapter.name}"
        if not (out / "config.json").exists():
            base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(out)
            for name in base_dir.iterdir():
                if name.name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges")):
                    shutil.copy(name, out / name.name)
        merged.append(out)
    return merged


def rss_bytes(pid: int) -> int:
    """Resident memory of a server process and its children (the engine core)."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def process_counters(pid: int) -> dict[str, dict[str, float]]:
    """Minor page faults and user / system CPU seconds so far of the server process, of its children (the engine
    core), and of this process (the load generator's clients): where the machine's cores go (an allocator that
    hands memory back to the system and faults it in again shows up in faults and system time)."""
    server = psutil.Process(pid)
    roles = {"server": [server], "engine_core": server.children(recursive=True), "load_generator": [psutil.Process()]}
    totals = {}
    for role, processes in roles.items():
        totals[role] = {"minor_faults": 0.0, "user_s": 0.0, "system_s": 0.0}
        for p in processes:
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                times = p.cpu_times()
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue
            totals[role]["minor_faults"] += float(fields[7])  # field 10 of proc(5): minflt
            totals[role]["user_s"] += times.user
            totals[role]["system_s"] += times.system
    return totals


class BatchSampler:
    """Polls the server's running and waiting request counts (vllm:num_requests_running / _waiting) every
    `interval_s` while the load runs: how full the running batch was over time."""

    def __init__(self, server: ServerProcess, interval_s: float = 0.5) -> None:
        self.server, self.interval_s = server, interval_s
        self.samples: list[tuple[float, float, float]] = []  # (s since start, running, waiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BatchSampler:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            text = self.server.metrics_text()
            self.samples.append((round(time.perf_counter() - self._start, 2),
                                 metric_value(text, NUM_REQUESTS_RUNNING), metric_value(text, NUM_REQUESTS_WAITING)))

    def summary(self) -> dict:
        running = [r for _, r, _ in self.samples]
        busy = [r for _, r, w in self.samples if r + w > 0]  # samples with any request in the engine
        return {"mean_running": statistics.fmean(busy) if busy else 0.0,
                "median_running": statistics.median(busy) if busy else 0.0,
                "share_running_at_least_24": sum(r >= 24 for r in busy) / len(busy) if busy else 0.0,
                "max_running": max(running, default=0.0), "samples": self.samples}  # fmt: skip


def serve_and_load(command, log: Path, requests, concurrency: int) -> dict:
    with ServerProcess(command, log) as server:
        before = process_counters(server.process.pid)
        with BatchSampler(server) as sampler:
            run = asyncio.run(run_load(requests, LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency)))
        after = process_counters(server.process.pid)
        summary = summarize(run)
        summary["during_load"] = {role: {key: round(after[role][key] - before[role][key], 2) for key in after[role]}
                                  for role in after}  # fmt: skip
        summary["batch"] = sampler.summary()
        text = server.metrics_text()
        summary["rss_bytes"] = rss_bytes(server.process.pid)
        summary["lora_loads"] = metric_value(text, "hpi:lora_loads_total")
        summary["lora_evictions"] = metric_value(text, "hpi:lora_evictions_total")
    summary.pop("samples")
    return summary


def merged_run(plan: LoRAPlan, merged: list[Path], requests, log_dir: Path) -> dict:
    """All merged engines at once, each with its share of the clients and of the requests."""
    with ExitStack() as stack:
        # The engines' best setting here: their default step (the DecodeStack, as the LoRA server's) and the
        # machine's threads shared out, so that the engines do not oversubscribe the cores.
        flags = ("--kv-cache-memory", plan.merged_kv_cache_memory, "--max-model-len", str(plan.merged_max_model_len))
        threads = max(1, plan.num_threads // len(merged))
        commands = [hpi_command(threads, "--model", str(path), *flags) for path in merged]
        servers = [stack.enter_context(ServerProcess(command, log_dir / f"merged{i}.log"))
                   for i, command in enumerate(commands)]  # fmt: skip
        per = plan.concurrency // len(servers)
        shares = [requests[i :: len(servers)] for i in range(len(servers))]

        async def all_loads():
            return await asyncio.gather(*(run_load(share, LoadConfig(s.base_url, SERVED_MODEL_NAME, per))
                                          for s, share in zip(servers, shares, strict=True)))  # fmt: skip

        start = time.perf_counter()
        runs = asyncio.run(all_loads())
        wall_s = time.perf_counter() - start
        rss = sum(rss_bytes(s.process.pid) for s in servers)
    summaries = [summarize(run) for run in runs]
    num_output = sum(s["output_tokens_per_s"] * s["duration_s"] for s in summaries)
    return {"engines": len(servers), "concurrency_each": per, "threads_each": threads, "duration_s": wall_s,
            "output_tokens_per_s": num_output / wall_s, "num_errors": sum(s["num_errors"] for s in summaries),
            "rss_bytes": rss, "tpot_ms_p50_each": [s["tpot_ms"]["p50"] for s in summaries]}  # fmt: skip


def step_times(plan: LoRAPlan, base_dir: Path, adapters: list[Path]) -> dict:
    """Decode step time (ms: median and best of `num_timed_steps`) of `batch` requests over k distinct adapters,
    per engine, the engines taking turns step by step (so a load that changes during the run weighs on all
    alike): the base model; the LoRA step (the C++ kernel; both decode in the C++ DecodeStack); the eager LoRA
    step with torch ops (per-adapter groups or one-hot: the form before the kernel)."""
    from hpi_runtime.llm import LLM
    from hpi_runtime.lora.request import LoRARequest
    from hpi_runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=plan.num_timed_steps + 4, ignore_eos=True, temperature=0.0)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    prompt = list(range(100, 116))
    common = {"max_num_seqs": plan.step_batch, "kv_cache_memory_bytes": 128 << 20, "max_model_len": 256}
    lora_options = {**common, "enable_lora": True, "max_loras": plan.max_loras, "max_lora_rank": plan.rank}
    with ExitStack() as stack:
        engines = {
            "base": stack.enter_context(LLM(str(base_dir), **common)).engine,
            "lora": stack.enter_context(LLM(str(base_dir), **lora_options)).engine,
            "lora_eager_torch": stack.enter_context(LLM(str(base_dir), enforce_eager=True, **lora_options)).engine,
        }
        engines["lora_eager_torch"].executor.lora.batch.mode = "torch"
        out: dict = {}
        for batch in plan.step_batches:
            for k in plan.step_distinct:
                per_request = [loras[i % k] if k else None for i in range(batch)]
                times: dict[str, list[float]] = {mode: [] for mode in engines}
                for mode, engine in engines.items():
                    for i, lora in enumerate(per_request if mode != "base" else [None] * batch):
                        engine.add_request(f"s{time.monotonic_ns()}-{i}", prompt, params, lora_request=lora)
                    for _ in range(3):  # prefill, then the first decodes (adapters loaded into their slots)
                        engine.step()
                for _ in range(plan.num_timed_steps):
                    for mode, engine in engines.items():
                        start = time.perf_counter()
                        engine.step()
                        times[mode].append(time.perf_counter() - start)
                for engine in engines.values():
                    while engine.has_unfinished_requests():
                        engine.step()
                key = f"batch{batch}_distinct{k}"
                out[key] = {mode: {"median": 1000 * statistics.median(t), "best": 1000 * min(t)}
                            for mode, t in times.items()}  # fmt: skip
                print(f"  batch {batch}, {k} distinct (best ms):",
                      {m: round(v["best"], 1) for m, v in out[key].items()}, flush=True)  # fmt: skip
    return out


def cpu_isa() -> str:
    from hpi_runtime import cpu_features

    flags = [name for name, present in (("amx", cpu_features.has_amx()), ("avx512_bf16", cpu_features.has_fast_bf16()))
             if present]  # fmt: skip
    return ", ".join(flags) or "avx2 or less"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=LoRAPlan.num_requests)
    parser.add_argument("--output-len", type=int, default=LoRAPlan.output_len)
    parser.add_argument("--max-cpu-loras", type=int, help="the LoRA server's --max-cpu-loras (default: the server's)")
    parser.add_argument("--skip-merged", action="store_true", help="leave out the 8 merged engines")
    parser.add_argument("--phases", nargs="+",
                        help="run only these phases (base, base_bound, base_eager, lora, lora_bf16_slots, "
                             "lora_cpu_all, merged, step_ms)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora.json"))
    parser.add_argument("--resume", action="store_true", help="keep the phases --out already holds, run the rest")
    parser.add_argument("--rounds", type=int, default=1, help="run the phases in turn this many times")
    args = parser.parse_args(argv)
    plan = dataclasses.replace(LoRAPlan(), num_requests=args.num_requests, output_len=args.output_len,
                               max_cpu_loras=args.max_cpu_loras)  # fmt: skip
    from transformers import AutoTokenizer

    from hpi_runtime.embedded import ensure_embedded_model

    base_dir = ensure_embedded_model()
    work = cache_dir() / "bench-lora"
    adapters = build_adapters(base_dir, plan, work)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    spec = WorkloadSpec(plan.num_requests, LengthDist(plan.prompt_len), LengthDist(plan.output_len), seed=plan.seed)
    requests = build_requests(tokenizer, spec)
    names = [f"adapter{i}" for i in range(plan.num_adapters)]
    lora_requests = [dataclasses.replace(r, model=names[i % len(names)]) for i, r in enumerate(requests)]
    logs = Path("bench/results/tmp/lora-logs")
    kv = ("--kv-cache-memory", plan.kv_cache_memory)
    machine = {**machine_description(), "isa": cpu_isa()}  # the CPU's model and flags, as every bench records them
    results: dict = {"plan": asdict(plan), "machine": machine}
    if args.resume and args.out.exists():
        results = {**json.loads(args.out.read_text()), "machine_resumed": machine}
    modules = [f"{name}={path}" for name, path in zip(names, adapters, strict=True)]
    lora_flags = ("--enable-lora", "--max-loras", str(plan.max_loras), "--max-lora-rank", str(plan.rank),
                  "--lora-modules", *modules)  # fmt: skip
    if plan.max_cpu_loras is not None:
        lora_flags += ("--max-cpu-loras", str(plan.max_cpu_loras))
    bound_clients = max(1, plan.concurrency * plan.max_loras // plan.num_adapters)
    phases = {
        "base": ("base model alone", lambda: serve_and_load(
            hpi_command(plan.num_threads, *kv), logs / "base.log", requests, plan.concurrency)),
        # The slots' bound: a request runs only with its adapter in a slot, so with requests spread evenly the LoRA
        # server runs concurrency x max_loras / num_adapters of them at a time; the base model at that many clients.
        "base_bound": (f"base model alone, {bound_clients} clients", lambda: serve_and_load(
            hpi_command(plan.num_threads, *kv), logs / "base_bound.log", requests, bound_clients)),
        "base_eager": ("base model, eager step", lambda: serve_and_load(
            hpi_command(plan.num_threads, *kv, "--enforce-eager"), logs / "base_eager.log", requests,
            plan.concurrency)),
        "lora": (f"{plan.num_adapters} adapters, --max-loras {plan.max_loras}", lambda: serve_and_load(
            hpi_command(plan.num_threads, *kv, *lora_flags), logs / "lora.log", lora_requests, plan.concurrency)),
        # The slots in bf16 under an fp32 model (the CPUs without fast bf16 serve fp32): half the adapters' bytes
        "lora_bf16_slots": (f"{plan.num_adapters} adapters, --max-loras {plan.max_loras}, --lora-dtype bfloat16",
                            lambda: serve_and_load(hpi_command(plan.num_threads, *kv, *lora_flags, "--lora-dtype",
                                                               "bfloat16"), logs / "lora_bf16_slots.log",
                                                   lora_requests, plan.concurrency)),
        "lora_cpu_all": (f"{plan.num_adapters} adapters, --max-loras {plan.max_loras}, --max-cpu-loras "
                         f"{plan.num_adapters}", lambda: serve_and_load(
            hpi_command(plan.num_threads, *kv, *lora_flags, "--max-cpu-loras", str(plan.num_adapters)),
            logs / "lora_cpu_all.log", lora_requests, plan.concurrency)),
        "merged": (f"{plan.num_adapters} merged models in {plan.num_adapters} engines", lambda: merged_run(
            plan, merge_adapters(base_dir, adapters, work), requests, logs)),
        "step_ms": ("step time per distinct adapters", lambda: step_times(plan, base_dir, adapters)),
    }  # fmt: skip
    # Rounds: the chosen phases run in turn, round after round, so each round's ratios are taken under about
    # the same load of the shared machine (round r > 1 stores its phases as "key@r").
    for round_index in range(1, args.rounds + 1):
        for key, (what, run) in phases.items():
            stored = key if round_index == 1 else f"{key}@{round_index}"
            if (stored in results or (key == "merged" and args.skip_merged)
                    or (args.phases and key not in args.phases)):  # fmt: skip
                continue
            print(f"{what} (round {round_index}) ...", flush=True)
            load_before = psutil.getloadavg()
            results[stored] = {**run(), "load_avg_before": load_before, "load_avg_after": psutil.getloadavg()}
            # After every phase: a run cut short keeps what it measured (--resume goes on from there).
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**results, "load_avg_now": psutil.getloadavg()}, indent=1))
        suffix = "" if round_index == 1 else f"@{round_index}"
        if f"base{suffix}" not in results:
            continue
        base = results[f"base{suffix}"]
        for key in ("lora", "lora_cpu_all"):
            if f"{key}{suffix}" in results:
                lora = results[f"{key}{suffix}"]
                base_tps, lora_tps = base["output_tokens_per_s"], lora["output_tokens_per_s"]
                running = [r.get("batch", {}).get("mean_running", float("nan")) for r in (base, lora)]
                print(f"round {round_index}: output tok/s base {base_tps:.1f}, {key} {lora_tps:.1f} "
                      f"({lora_tps / base_tps:.2f}x base); mean running batch {running[0]:.1f} vs "
                      f"{running[1]:.1f}")  # fmt: skip
                if f"base_bound{suffix}" in results:
                    bound_tps = results[f"base_bound{suffix}"]["output_tokens_per_s"]
                    print(f"  the slots' bound (base at {bound_clients} clients): {bound_tps:.1f} tok/s, "
                          f"{bound_tps / base_tps:.2f}x base; {key} at {lora_tps / bound_tps:.2f}x the bound")
    for key in ("lora", "lora_cpu_all"):
        ratios = [results[f"{key}{suffix}"]["output_tokens_per_s"] / results[f"base{suffix}"]["output_tokens_per_s"]
                  for suffix in ("", *(f"@{r}" for r in range(2, args.rounds + 1)))
                  if f"{key}{suffix}" in results and f"base{suffix}" in results]  # fmt: skip
        if len(ratios) > 1:  # one round's ratio mostly says which phase the machine's drift hit
            print(f"{key} / base over {len(ratios)} rounds: median {statistics.median(ratios):.2f}, "
                  f"{min(ratios):.2f}-{max(ratios):.2f}")
    if "merged" in results:
        merged_tps = results["merged"]["output_tokens_per_s"]
        print(f"8 merged engines: {merged_tps:.1f} tok/s, {results['merged']['rss_bytes'] / 2**30:.2f} GiB "
              f"vs LoRA server {results['lora']['rss_bytes'] / 2**30:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
