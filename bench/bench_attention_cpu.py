"""CPU attention benchmark: the paged C++ kernel against the torch backend's gather + SDPA, one layer.

One layer of the embedded model's attention (9 q heads, 3 kv heads, head_dim 64, block 16) over a paged
cache with scattered blocks, fp32 and bf16:
- decode steps of 64 requests whose context lengths are uniform, spread out, or skewed like chat traffic;
- prefill steps: one 512-token prompt, and four 128-token chunks after 0/128/256/384 cached tokens.
Each path runs one layer's whole attention call: writing the step's K/V into the cache and attending.
"gather" is `TorchAttentionBackend` (index_select of every context into a padded tensor, masked SDPA; decodes
bucketed by context length); "paged" is `hpi_kernels.cpu.paged_attention_cpu` reading the cache in place.
The paths run alternately in the same process so that machine noise hits both alike; each row reports
the median and the best ms per layer call. Results go to bench/results/attention_cpu.md with the CPU's ISA flags.

    .venv/bin/python bench/bench_attention_cpu.py
    .venv/bin/python bench/bench_attention_cpu.py --threads 1 2 --repeats 3 --out /tmp/attention_cpu.md
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/bench_attention_cpu.py --append   # + an AVX2 section
    .venv/bin/python bench/bench_attention_cpu.py --buckets   # the torch backend: one decode group vs buckets
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from hpi_kernels.cpu import cpu_capability, load_extension, paged_attention_cpu
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
RESULTS = Path(__file__).parent / "results" / "attention_cpu.md"
TITLE = "# CPU attention: paged C++ kernel vs gather + SDPA"


def _scenarios(num_reqs: int, seed: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    num_long = max(1, num_reqs // 10)
    short = torch.randint(32, 257, (num_reqs - num_long,), generator=generator)
    long = torch.randint(1024, 2049, (num_long,), generator=generator)
    # The runner's decode order is admission order, not length: shuffle so that buckets gather out of order.
    skewed = torch.cat([short, long])[torch.randperm(num_reqs, generator=generator)]
    return {
        "uniform 512": [512] * num_reqs,
        "random 32..2048": torch.randint(32, 2049, (num_reqs,), generator=generator).tolist(),
        "chat skew": skewed.tolist(),
    }


def _prefill_scenarios() -> dict[str, list[tuple[int, int]]]:
    """(query_len, context_len) per request."""
    return {
        "prefill 1x512": [(512, 512)],
        "prefill 4x128 after 0..384": [(128, 128 + prefix) for prefix in (0, 128, 256, 384)],
    }


@dataclass(frozen=True)
class Step:
    common: AttentionMetadata
    q: torch.Tensor  # [num_tokens, H, D]
    k: torch.Tensor  # [num_tokens, H_kv, D]
    v: torch.Tensor  # [num_tokens, H_kv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.k_cache, self.v_cache


def _step(requests: list[tuple[int, int]], seed: int, dtype: torch.dtype = torch.float32) -> Step:
    """One step's common metadata and tensors; decodes (query_len 1) must come first, as the runner orders them."""
    generator = torch.Generator().manual_seed(seed)
    context_lens = [context_len for _, context_len in requests]
    query_lens = [query_len for query_len, _ in requests]
    blocks_per_req = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_req) + 1
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
    first = 0
    for row, n in enumerate(blocks_per_req):
        block_tables[row, :n] = order[first : first + n]
        first += n
    # Slots of each request's new tokens: the last query_len positions of its context.
    positions = torch.cat([torch.arange(c - q, c) for q, c in requests])
    rows = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(query_lens))
    slot_mapping = block_tables[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    common = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        num_decode_reqs=sum(1 for q in query_lens if q == 1),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_size=BLOCK_SIZE,
    )
    num_tokens = sum(query_lens)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return Step(
        common,
        randn(num_tokens, NUM_HEADS, HEAD_DIM),
        randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        randn(*cache_shape),
        randn(*cache_shape),
    )


def _decode_step(context_lens: list[int], seed: int) -> tuple[AttentionMetadata, tuple[torch.Tensor, ...]]:
    """Common metadata of one fp32 decode step and its tensors: q, k, v and the layer's k/v caches."""
    step = _step([(1, n) for n in context_lens], seed)
    return step.common, step.tensors()


def paged_forward(step: Step) -> torch.Tensor:  # [num_tokens, H, D]
    """What a paged backend's layer call does: write the step's K/V into the cache, then attend in place."""
    k_flat = step.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    v_flat = step.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    k_flat.index_copy_(0, step.common.slot_mapping, step.k)
    v_flat.index_copy_(0, step.common.slot_mapping, step.v)
    out = step.q.new_empty(step.q.shape)
    common = step.common
    paged_attention_cpu(
        out, step.q, step.k_cache, step.v_cache, common.block_tables, common.query_start_loc, common.context_lens, SCALE
    )
    return out


def _call_ms(fn: Callable[[], object], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _time_alternately(
    calls: dict[str, Callable[[], object]], repeats: int, num_calls: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median (of per-round medians) and best ms per call of each callable, the callables taking turns.

    The best call is what the code costs when no other process interrupts it; the median includes the
    interruptions of a shared machine, which hit a multi-threaded call whenever any of its threads is descheduled.
    """
    medians: dict[str, list[float]] = {key: [] for key in calls}
    best: dict[str, float] = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for key, call in calls.items():
            call()  # brings this variant's working set into the caches
            times = _call_ms(call, num_calls)
            medians[key].append(statistics.median(times))
            best[key] = min(best[key], *times)
    return {key: statistics.median(values) for key, values in medians.items()}, best


def _isa() -> str:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
    found = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    return f"{model}; {os.cpu_count()} logical CPUs; flags: {' '.join(found) or 'none of avx2/avx512'}"


def compare_paged(args: argparse.Namespace) -> list[str]:
    """Markdown lines: gather + SDPA against the paged kernel per thread count, dtype and scenario."""
    start = time.perf_counter()
    load_extension()
    build_s = time.perf_counter() - start
    load_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    notes = []
    if forced := os.environ.get("ATEN_CPU_CAPABILITY"):
        notes.append(
            f"- ATEN_CPU_CAPABILITY={forced}: torch's own kernels and the extension use that level; libraries with "
            "their own CPU dispatch (oneDNN, MKL) may still use more of this CPU"
        )
    if load_1m > 0.5:
        notes.append(
            f"- the machine was busy (load {load_1m:.1f} on {os.cpu_count()} CPUs): a multi-threaded call waits for "
            "its slowest thread, so its medians include whole scheduler ticks lost to other processes (the gather "
            "path, with many parallel regions per call, loses most); the 1-thread rows and the best calls compare "
            "cleaner"
        )
    header = [
        f"## {cpu_capability()} build ({', '.join(map(str, args.threads))} threads)",
        "",
        "`bench/bench_attention_cpu.py`: one layer of the embedded model's attention (9 q / 3 kv heads, head_dim 64,",
        "block 16), K/V write + attention per call, ms per layer call (median / best); the two paths alternate.",
        "gather = `TorchAttentionBackend` (decodes bucketed by context length, prefill chunks padded into one",
        "masked SDPA); paged = `hpi_kernels.cpu.paged_attention_cpu`. speed-up = gather ms / paged ms (of the",
        "medians, and of the best calls: the best call is the cost without interruptions by other processes).",
        "",
        f"- CPU: {_isa()}",
        f"- torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()} (extension built for "
        f"{cpu_capability()}); extension load {build_s:.1f} s (a build when not cached)",
        f"- load average at start: {load_1m:.2f} (the machine is shared); median of the medians of {args.repeats} "
        f"alternating rounds of {args.calls} calls, best of all those calls",
        *notes,
        "",
        "| threads | dtype | step | new tokens | context tokens | gather ms | paged ms | speed-up | speed-up (best) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(header), flush=True)
    lines = list(header)
    scenarios = {name: [(1, n) for n in lens] for name, lens in _scenarios(args.num_reqs, args.seed).items()}
    if not args.decode_only:
        scenarios.update(_prefill_scenarios())
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            backend = TorchAttentionBackend(dtype)
            for name, requests in scenarios.items():
                step = _step(requests, args.seed, dtype)
                metadata = backend.build_metadata(step.common)
                gather = partial(backend.forward, *step.tensors(), metadata, SCALE)
                paged = partial(paged_forward, step)
                torch.testing.assert_close(paged(), gather(), **_tolerance(dtype))
                median, best = _time_alternately({"gather": gather, "paged": paged}, args.repeats, args.calls)
                line = (
                    f"| {threads} | {str(dtype).removeprefix('torch.')} | {name} | {sum(q for q, _ in requests)} | "
                    f"{sum(c for _, c in requests)} | {median['gather']:.2f} / {best['gather']:.2f} | "
                    f"{median['paged']:.2f} / {best['paged']:.2f} | {median['gather'] / median['paged']:.2f}x | "
                    f"{best['gather'] / best['paged']:.2f}x |"
                )
                print(line, flush=True)
                lines.append(line)
    return lines


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


def _padded_slots(metadata: TorchAttentionMetadata) -> int:
    return sum(g.key_slots.numel() for g in metadata.decode_groups)


def compare_buckets(args: argparse.Namespace) -> None:
    """The torch backend's decode step (fp32) with one padded group vs context-length buckets."""
    overrides = {"max_decode_groups": args.max_groups, "group_cost_slots": args.group_cost_slots}
    backends = {
        "single": TorchAttentionBackend(torch.float32, max_decode_groups=1),
        "bucketed": TorchAttentionBackend(torch.float32, **{k: v for k, v in overrides.items() if v is not None}),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.num_reqs} decodes, one layer")
    header = f"{'contexts':<16} {'real slots':>10} {'groups':>6} {'padded':>15} {'single ms':>9} {'bucket ms':>9}"
    print(f"{header} {'ratio':>6} {'meta ms 1/b':>12}")
    for name, context_lens in _scenarios(args.num_reqs, args.seed).items():
        common, tensors = _decode_step(context_lens, args.seed)
        metadata = {key: backend.build_metadata(common) for key, backend in backends.items()}
        calls = {key: partial(backend.forward, *tensors, metadata[key], SCALE) for key, backend in backends.items()}
        forward_ms, _ = _time_alternately(calls, args.repeats, args.calls)
        meta_calls = {key: partial(backend.build_metadata, common) for key, backend in backends.items()}
        meta_ms, _ = _time_alternately(meta_calls, args.repeats, args.calls)
        padded = f"{_padded_slots(metadata['single'])}/{_padded_slots(metadata['bucketed'])}"
        num_groups = len(metadata["bucketed"].decode_groups)
        print(
            f"{name:<16} {sum(context_lens):>10} {num_groups:>6} {padded:>15} {forward_ms['single']:>9.2f} "
            f"{forward_ms['bucketed']:>9.2f} {forward_ms['single'] / forward_ms['bucketed']:>6.2f} "
            f"{meta_ms['single']:>5.2f}/{meta_ms['bucketed']:<5.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="one table section per count")
    parser.add_argument("--repeats", type=int, default=7, help="alternating rounds; each times --calls calls")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="markdown report (paged comparison)")
    parser.add_argument("--append", action="store_true", help="add a section to --out instead of replacing it")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill steps")
    parser.add_argument("--buckets", action="store_true", help="instead: the torch backend, one group vs buckets")
    parser.add_argument("--max-groups", type=int, default=None, help="--buckets: bucketed backend's cap")
    parser.add_argument("--group-cost-slots", type=int, default=None, help="--buckets: bucketed backend's price")
    args = parser.parse_args()
    if args.buckets:
        torch.set_num_threads(args.threads[0])
        compare_buckets(args)
        return
    lines = compare_paged(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.append and args.out.exists():
        args.out.write_text(args.out.read_text() + "\n" + "\n".join(lines) + "\n")
    else:
        args.out.write_text("\n".join([TITLE, "", *lines]) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
