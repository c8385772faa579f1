"""The runtime's `triton` attention backend gives the `torch` backend's results on a mixed batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.attention.torch_backend import TorchAttentionBackend
from hpi_runtime.attention.triton_backend import TritonAttentionBackend


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, 2.0)], ids=["global", "sliding-window-softcap"])
@pytest.mark.parametrize(
    "requests",
    [
        pytest.param([(17, 1), (1, 1), (37, 5), (20, 20)], id="decodes-then-prefills"),
        pytest.param([(16, 1), (40, 1)], id="decodes-only"),
        pytest.param([(33, 33), (50, 18)], id="prefills-only"),
    ],
)
def test_triton_backend_matches_torch_backend(paged_cache, device, requests, window, softcap) -> None:
    """requests: (context_len, q_len), decodes (q_len 1) first, as the model runner orders them."""
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    context_lens = [c for c, _ in requests]
    q_lens = [q for _, q in requests]
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    block_tables = cache.block_tables.long().cpu()
    slots = [
        int(block_tables[r, pos // block_size]) * block_size + pos % block_size
        for r, (c, n) in enumerate(requests)
        for pos in range(c - n, c)
    ]
    common = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=cache.block_tables,
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        context_lens=cache.context_lens,
        num_decode_reqs=sum(1 for n in q_lens if n == 1),
        max_query_len=max(q_lens),
        max_context_len=max(context_lens),
        block_size=block_size,
    )
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
        metadata = backend.build_metadata(common)
        out = backend.forward(q, k, v, k_cache, v_cache, metadata, head_dim**-0.5, sliding_window=window,
                              logit_softcap=softcap)  # fmt: skip
        results.append((out, k_cache, v_cache))
    (expected, k_expected, v_expected), (out, k_cache, v_cache) = results
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about paged attention."}],
    [{"role": "user", "content": "Count from one to twenty in words."}],
]


@pytest.mark.gpu
def test_embedded_model_on_cuda_with_triton_matches_the_cpu_reference(embedded_model_dir: Path) -> None:
    """Greedy tokens of the embedded model: CUDA + triton backend == CPU + torch backend (fp32 both)."""
    from hpi_runtime.llm import LLM
    from hpi_runtime.sampling_params import SamplingParams

    prompts = CHAT_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=32)
    # Small max_num_batched_tokens: prompts get chunked, so extend-over-prefix and mixed batches run too.
    options = {
        "dtype": "float32",
        "max_num_batched_tokens": 24,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 * 2**20,
    }
    cpu = LLM(embedded_model_dir, device="cpu", attention_backend="torch", **options).chat(prompts, params)
    gpu = LLM(embedded_model_dir, device="cuda", attention_backend="triton", **options).chat(prompts, params)
    assert [o.output_token_ids for o in gpu] == [o.output_token_ids for o in cpu]
    assert "Paris" in gpu[0].text


# Chat prompts whose greedy tokens win by a clear margin: in fp32 the top logprob beats the runner-up by at
# least 0.55 nats at each of the first 8 steps (0.08 for "What is the capital of France?", whose first token
# "The" vs "L" rounds to an exact tie in bf16 logits, so any 16-bit implementation may answer either).
WIDE_MARGIN_PROMPTS = [
    [{"role": "user", "content": "Name the capital of France."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Tell me the capital of France."}],
    [{"role": "user", "content": "List three primary colors."}],
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_embedded_model_on_cuda_in_16_bit_matches_transformers(dtype: str, embedded_model_dir: Path) -> None:
    """bf16 / fp16 on CUDA with the triton backend: the answer names Paris, and the first greedy tokens equal
    transformers' greedy generate in the same dtype on the same GPU. Only the first few: 16-bit rounding
    differs between the two implementations, so later near-ties may go either way."""
    from transformers import AutoModelForCausalLM

    from hpi_runtime.llm import LLM
    from hpi_runtime.sampling_params import SamplingParams

    num_compared = 8
    llm = LLM(
        embedded_model_dir,
        device="cuda",
        dtype=dtype,
        attention_backend="triton",
        max_num_batched_tokens=24,  # chunked prefill, as in the fp32 test above
        max_model_len=512,
        kv_cache_memory_bytes=64 * 2**20,
    )
    assert llm.bundle.resolved.dtype == dtype
    answer = llm.chat(WIDE_MARGIN_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in answer.text, answer.text
    # min_tokens bans EOS so that every prompt yields num_compared tokens to compare.
    params = SamplingParams(temperature=0.0, max_tokens=num_compared, min_tokens=num_compared)
    outputs = llm.chat(WIDE_MARGIN_PROMPTS, params)
    llm.shutdown()
    hf_model = AutoModelForCausalLM.from_pretrained(llm.bundle.resolved.model_dir, dtype=getattr(torch, dtype))
    hf_model = hf_model.to("cuda").eval()
    for output in outputs:
        prompt = torch.tensor([output.prompt_token_ids], device="cuda")
        with torch.no_grad():
            expected = hf_model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=num_compared,
                min_new_tokens=num_compared,
            )[0, prompt.shape[1] :].tolist()
        assert list(output.output_token_ids) == expected, output.text
