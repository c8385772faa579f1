"""LoRA with the host KV tier: prefix blocks offloaded from the device under one adapter are restored for the
same adapter only. Another adapter and the base model sending the same prompt find nothing in either tier
(their tokens are their own, as transformers + peft make them), and the first adapter's return does."""

from __future__ import annotations

import torch

from hpi_runtime.llm import LLM
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.sampling_params import SamplingParams
from hpi_testing.lora_adapters import greedy, reference_model

BLOCK = 8
TOKEN_BYTES = 512  # the tiny model in fp32: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes
MAX_TOKENS = 4


def test_offloaded_prefix_blocks_never_cross_adapters(tiny_model_dir, adapters):
    loras = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(("all", "attn"))}
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (48,), generator=generator).tolist()  # 6 blocks
    fillers = [torch.randint(3, 256, (56,), generator=generator).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # A device pool of 16 blocks: the fillers evict the prompt's blocks, which go to the host tier.
    with LLM(str(tiny_model_dir), dtype="float32", block_size=BLOCK, max_model_len=128, max_num_seqs=2,
             kv_cache_memory_bytes=16 * BLOCK * TOKEN_BYTES, kv_offload_bytes=128 * BLOCK * TOKEN_BYTES,
             enforce_eager=True, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:  # fmt: skip
        engine = llm.engine

        def run(lora: LoRARequest | None) -> tuple[list[int], int, int]:
            before = engine.get_stats()
            tokens = list(llm.generate([prompt], params, lora_request=lora)[0].output_token_ids)
            after = engine.get_stats()
            return tokens, after.prefix_cache_hits - before.prefix_cache_hits, after.prefix_cache_host_hits

        first, _, _ = run(loras["all"])
        for filler in fillers:
            llm.generate([filler], params, lora_request=loras["all"])
        assert engine.get_stats().kv_blocks_to_host > 0  # the prompt's blocks are offloaded
        host_hits_before = engine.get_stats().prefix_cache_host_hits
        other, other_hits, host_hits = run(loras["attn"])
        base, base_hits, host_hits_after_base = run(None)
        assert other_hits == 0 and base_hits == 0 and host_hits_after_base == host_hits == host_hits_before
        again, again_hits, host_hits_again = run(loras["all"])
    assert again_hits > 0 and host_hits_again > host_hits_before  # restored from the host tier for "all"
    assert again == first
    assert other == greedy(reference_model(tiny_model_dir, adapters["attn"]), prompt, MAX_TOKENS)[0]
    assert base == greedy(reference_model(tiny_model_dir, None), prompt, MAX_TOKENS)[0]
    assert first == greedy(reference_model(tiny_model_dir, adapters["all"]), prompt, MAX_TOKENS)[0]
