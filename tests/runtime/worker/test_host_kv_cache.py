"""The host KV tier with a real model: the executor's block copies are exact in fp32 and bf16, and an engine
whose device pool is far too small for its conversations gives the same greedy tokens with the tier on as
off, while loading evicted prefixes and swapped-out requests back instead of recomputing them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpi_runtime.core.interface import KVTransfers, SchedulerOutput
from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.host_kv_cache import HostKVCache, num_host_blocks_for_budget

BLOCK = 8
TOKEN_BYTES = 512  # the tiny model in fp32: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes


class _Layers:
    """Stands in for a model: HostKVCache reads only each attention layer's k_cache and v_cache."""

    def __init__(self, num_layers: int, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(0)
        shape = (num_blocks, BLOCK, 2, 16)
        self.layers = [
            SimpleNamespace(k_cache=torch.randn(shape, generator=generator).to(device, dtype),
                            v_cache=torch.randn(shape, generator=generator).to(device, dtype))
            for _ in range(num_layers)
        ]  # fmt: skip

    def attention_layers(self):
        return self.layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copies_round_trip_bit_exactly(dtype: torch.dtype, device: str) -> None:
    """On CUDA: pinned host pool, offloads on a side stream overlapping later work, loads on the compute stream."""
    model = _Layers(num_layers=3, num_blocks=10, dtype=dtype, device=torch.device(device))
    host = HostKVCache(model, num_blocks=6, device=torch.device(device))
    assert host.num_bytes == 3 * 2 * 6 * BLOCK * 2 * 16 * dtype.itemsize
    originals = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in model.layers]
    host.apply(KVTransfers(to_host=((7, 0), (2, 5), (9, 3))))
    # Device blocks 7, 2 and 9 are overwritten (evicted, reused), then their copies come back elsewhere. In
    # one step device block 0 goes out to host block 1 and that copy comes back: device -> host runs first.
    for layer in model.layers:
        layer.k_cache[[7, 2, 9]] = 0
        layer.v_cache[[7, 2, 9]] = 0
    host.apply(KVTransfers(to_host=((0, 1),), to_device=((0, 4), (5, 9), (3, 1), (1, 0))))
    for layer, (k, v) in zip(model.layers, originals, strict=True):
        for cache, original in ((layer.k_cache, k), (layer.v_cache, v)):
            assert torch.equal(cache[4], original[7]) and torch.equal(cache[9], original[2])
            assert torch.equal(cache[1], original[9]) and torch.equal(cache[0], original[0])
            assert torch.equal(cache[3], original[3])  # untouched


def test_budget_in_blocks() -> None:
    assert num_host_blocks_for_budget(0, 4096) == 0
    assert num_host_blocks_for_budget(10_000, 4096) == 2
    with pytest.raises(ValueError, match="holds no KV block"):
        num_host_blocks_for_budget(100, 4096)
    with pytest.raises(ValueError, match="must not be negative"):
        num_host_blocks_for_budget(-1, 4096)


def _conversations(llm: LLM, num_turns: int = 3) -> tuple[list[list[int]], object]:
    """Six conversations, each turn resending its history plus the model's answer and a new user turn, with
    the device pool (24 blocks) holding about one conversation: every turn's history has been evicted."""
    generator = torch.Generator().manual_seed(1)
    vocab_size = len(llm.tokenizer)
    histories = [torch.randint(3, vocab_size, (40,), generator=generator).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    answers = []
    for _ in range(num_turns):
        outputs = llm.generate(histories, params)
        answers.append([output.output_token_ids for output in outputs])
        histories = [
            history + list(output.output_token_ids) + torch.randint(3, vocab_size, (9,), generator=generator).tolist()
            for history, output in zip(histories, outputs, strict=True)
        ]
    return answers, llm.engine.get_stats()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
def test_same_greedy_tokens_with_the_tier_and_far_less_prefill(tiny_model_dir: Path, kv_cache_dtype: str) -> None:
    """bfloat16 (fp8): a half (a quarter) of the fp32 budget holds the same 24 blocks, and the tier moves its two-
    (one-) byte blocks."""
    token_bytes = TOKEN_BYTES // {"auto": 1, "bfloat16": 2, "fp8": 4}[kv_cache_dtype]
    options = dict(dtype="float32", block_size=BLOCK, max_model_len=128, max_num_seqs=6, kv_cache_dtype=kv_cache_dtype,
                   kv_cache_memory_bytes=24 * BLOCK * token_bytes, enforce_eager=True)  # fmt: skip
    off = LLM(tiny_model_dir, **options)
    assert off.engine.executor.num_kv_blocks == 24
    answers_off, stats_off = _conversations(off)
    off.shutdown()
    on = LLM(tiny_model_dir, kv_offload_bytes=256 * BLOCK * token_bytes, **options)
    answers_on, stats_on = _conversations(on)
    # The last step's finished requests reach the runner with the next step, even one of block copies alone.
    runner = on.engine.executor.runner
    pending = frozenset(runner.input_batch.row_of)
    assert pending
    copies_only = SchedulerOutput((), (), {}, 0, finished_request_ids=pending, kv_transfers=KVTransfers(((0, 0),)))
    on.engine.executor.execute_model(copies_only)
    assert not runner.input_batch.row_of
    on.shutdown()
    assert answers_on == answers_off
    assert stats_on.prefix_cache_host_hits > 0 and stats_on.kv_blocks_to_device > 0
    assert stats_on.kv_blocks_to_host > 0
    assert stats_off.num_preemptions > 0 and stats_on.num_swapped_preemptions > 0
    assert stats_on.num_prefill_tokens_computed < stats_off.num_prefill_tokens_computed / 2


def test_tensor_parallel_ranks_copy_their_own_shards(tiny_model_dir: Path) -> None:
    """Every rank holds its KV heads' share of each block, on device and on host: the same block ids move on
    all ranks at once, and the answers match one process."""
    options = dict(dtype="float32", block_size=BLOCK, max_model_len=128, max_num_seqs=6,
                   kv_cache_memory_bytes=24 * BLOCK * TOKEN_BYTES // 2, enforce_eager=True)  # fmt: skip
    single = LLM(tiny_model_dir, **{**options, "kv_cache_memory_bytes": 24 * BLOCK * TOKEN_BYTES})
    answers_single, _ = _conversations(single, num_turns=2)
    single.shutdown()
    sharded = LLM(tiny_model_dir, tensor_parallel_size=2, kv_offload_bytes=128 * BLOCK * TOKEN_BYTES // 2, **options)
    answers_sharded, stats = _conversations(sharded, num_turns=2)
    sharded.shutdown()
    assert sharded.bundle.footprint.num_kv_blocks == 24
    assert answers_sharded == answers_single
    assert stats.kv_blocks_to_device > 0 and stats.prefix_cache_host_hits > 0
