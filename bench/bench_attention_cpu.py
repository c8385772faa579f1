"""CPU attention benchmark: the torch backend's decode step with one padded group vs length buckets.

One layer of the embedded model's attention (9 q heads, 3 kv heads, head_dim 64, block 16, fp32) over a
paged cache with scattered blocks, for decode batches whose context lengths are uniform, spread out, or
skewed like chat traffic. The two backends run alternately in the same process so that machine noise
hits both alike; each row reports the median ms per layer call, the padded key slots each gathers, and
the once-per-step `build_metadata` time.

    .venv/bin/python bench/bench_attention_cpu.py
    .venv/bin/python bench/bench_attention_cpu.py --num-reqs 32 --max-groups 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from hpi_runtime.model.attention import AttentionMetadata, TorchAttentionBackend, TorchAttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


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


def _decode_step(context_lens: list[int], seed: int) -> tuple[AttentionMetadata, tuple[torch.Tensor, ...]]:
    """Common metadata of one decode step and its tensors: q, k, v and the layer's k/v caches."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_req) + 1
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_req), dtype=torch.int32)
    first = 0
    for row, n in enumerate(blocks_per_req):
        block_tables[row, :n] = order[first : first + n]
        first += n
    lens = torch.tensor(context_lens)
    last = lens - 1
    slot_mapping = block_tables[torch.arange(len(lens)), last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    num_reqs = len(context_lens)
    common = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
        context_lens=lens.to(torch.int32),
        num_decode_reqs=num_reqs,
        max_query_len=1,
        max_context_len=max(context_lens),
        block_size=BLOCK_SIZE,
    )
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tensors = (
        torch.randn(num_reqs, NUM_HEADS, HEAD_DIM, generator=generator),  # q [num_tokens, H, D]
        torch.randn(num_reqs, NUM_KV_HEADS, HEAD_DIM, generator=generator),  # k [num_tokens, H_kv, D]
        torch.randn(num_reqs, NUM_KV_HEADS, HEAD_DIM, generator=generator),  # v [num_tokens, H_kv, D]
        torch.randn(cache_shape, generator=generator),  # k_cache [num_blocks, block_size, H_kv, D]
        torch.randn(cache_shape, generator=generator),  # v_cache [num_blocks, block_size, H_kv, D]
    )
    return common, tensors


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _padded_slots(metadata: TorchAttentionMetadata) -> int:
    return sum(g.key_slots.numel() for g in metadata.decode_groups)


def _time_alternately(
    backends: dict[str, TorchAttentionBackend],
    common: AttentionMetadata,
    tensors: tuple[torch.Tensor, ...],
    repeats: int,
    calls: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms of one layer's forward and of build_metadata per backend, the backends taking turns."""
    forward_ms: dict[str, list[float]] = {key: [] for key in backends}
    meta_ms: dict[str, list[float]] = {key: [] for key in backends}
    for _ in range(repeats):
        for key, backend in backends.items():
            call = partial(backend.forward, *tensors, backend.build_metadata(common), HEAD_DIM**-0.5)
            call()  # brings this variant's working set into the caches
            forward_ms[key].append(_median_ms(call, calls))
            meta_ms[key].append(_median_ms(partial(backend.build_metadata, common), calls))
    return (
        {key: statistics.median(ms) for key, ms in forward_ms.items()},
        {key: statistics.median(ms) for key, ms in meta_ms.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="alternating rounds; each times --calls calls")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--max-groups", type=int, default=None, help="bucketed backend's cap (default: its own)")
    parser.add_argument("--group-cost-slots", type=int, default=None, help="bucketed backend's per-group price")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
        forward_ms, meta_ms = _time_alternately(backends, common, tensors, args.repeats, args.calls)
        padded = f"{_padded_slots(metadata['single'])}/{_padded_slots(metadata['bucketed'])}"
        num_groups = len(metadata["bucketed"].decode_groups)
        print(
            f"{name:<16} {sum(context_lens):>10} {num_groups:>6} {padded:>15} {forward_ms['single']:>9.2f} "
            f"{forward_ms['bucketed']:>9.2f} {forward_ms['single'] / forward_ms['bucketed']:>6.2f} "
            f"{meta_ms['single']:>5.2f}/{meta_ms['bucketed']:<5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
