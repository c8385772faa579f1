"""LoRA adapters in the engine: greedy tokens and logprobs equal transformers + peft for each adapter, in
batches that mix three adapters and the base model, with fewer device slots than adapters (so adapters are
swapped in and out of the slots and evicted from host memory); and the prefix cache never shares KV between
an adapter and another adapter or the base model."""

from __future__ import annotations

import pytest

from hpi_runtime.llm import LLM
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.sampling_params import SamplingParams
from hpi_testing.lora_adapters import greedy, reference_greedy, reference_model

PROMPTS = ["The capital of France is", "Hello world! How", "one two three four", "def add(a, b):",
           "A paged KV cache", "Kubernetes operators"]  # fmt: skip
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # Two slots and two host copies for three adapters: every batch swaps, and host memory evicts.
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
             enforce_eager=True, max_num_seqs=8) as llm:  # fmt: skip
        yield llm


def test_mixed_batch_matches_transformers_and_peft(llm, tiny_model_dir, adapters):
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    # Each prompt under every adapter and the base model, all in one generate call (so in shared batches).
    cases = [(prompt, name) for prompt in PROMPTS[:3] for name in (*loras, None)]
    prompt_ids = [llm.tokenizer(prompt).input_ids for prompt, _ in cases]
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0),
                           lora_request=[loras[name] if name else None for _, name in cases])  # fmt: skip
    references = {name: reference_model(tiny_model_dir, adapters[name] if name else None) for name in (*loras, None)}
    for (prompt, name), ids, output in zip(cases, prompt_ids, outputs, strict=True):
        tokens, logprobs = greedy(references[name], ids, MAX_TOKENS)
        assert list(output.output_token_ids) == tokens, (prompt, name)
        ours = [entry.logprob for entry in output.new_logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-4), (prompt, name)
    # The adapters really differ from the base model and from each other on these prompts.
    assert len({tuple(o.output_token_ids) for o in outputs}) > len(PROMPTS[:3]) * 2
    stats = llm.engine.get_stats()
    assert stats.lora_slot_loads >= 3 and stats.lora_host_evictions >= 1  # 3 adapters through 2 slots / 2 copies


def test_prefix_cache_is_keyed_by_adapter(llm, adapters):
    lora = LoRARequest("attn", 2, str(adapters["attn"]))
    prompt = llm.tokenizer("one two three four five six seven eight nine ten eleven twelve " * 3).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine = llm.engine
    hits_before = engine.get_stats().prefix_cache_hits
    llm.generate([prompt], params)  # the base model's blocks are cached
    llm.generate([prompt], params, lora_request=lora)  # not reused for the adapter
    assert engine.get_stats().prefix_cache_hits == hits_before
    llm.generate([prompt], params, lora_request=lora)  # the adapter's own blocks are
    assert engine.get_stats().prefix_cache_hits > hits_before


def test_bad_lora_requests_are_refused(llm, tiny_model_dir, adapters, tmp_path):
    from hpi_testing.lora_adapters import build_adapter

    big = build_adapter(tiny_model_dir, tmp_path / "big", rank=16, targets=("q_proj",))
    with pytest.raises(ValueError, match="rank 16 is greater than max_lora_rank 8"):
        llm.generate(["x"], SamplingParams(max_tokens=1), lora_request=LoRARequest("big", 9, str(big)))
    # An id names one directory: this test uses its own id, so it holds whichever tests ran before it on this
    # module's engine (pytest-xdist may run them on another worker).
    llm.generate(["x"], SamplingParams(max_tokens=1), lora_request=LoRARequest("first", 41, str(adapters["attn"])))
    with pytest.raises(ValueError, match="already used"):
        llm.generate(["x"], SamplingParams(max_tokens=1), lora_request=LoRARequest("other", 41, str(adapters["mlp"])))
    with LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True) as plain:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.generate(["x"], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, str(big)))


@pytest.mark.slow
def test_tensor_parallel_shards_the_adapters_like_their_layers(tiny_model_dir, adapters):
    """tp 2: A and B are cut like the projection they adapt (column-parallel: B's rows; row-parallel: A's
    columns, the delta summed by the layer's all-reduce); greedy tokens still equal transformers + peft."""
    loras = [LoRARequest("all", 1, str(adapters["all"])), LoRARequest("attn", 2, str(adapters["attn"])), None]
    # Four slots, two adapters in the batch: the per-adapter grouped path (the others test the one-hot one).
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, enable_lora=True, max_loras=4, max_lora_rank=8,
             dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 * 2**20) as llm:  # fmt: skip
        ids = llm.tokenizer(PROMPTS[4]).input_ids
        outputs = llm.generate([ids] * 3, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), lora_request=loras)
    for lora, output in zip(loras, outputs, strict=True):
        expected, _ = reference_greedy(tiny_model_dir, adapters[lora.lora_name] if lora else None, ids, MAX_TOKENS)
        assert list(output.output_token_ids) == expected


@pytest.mark.parametrize("slot_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [[0, -1, 1, 1, 0, -1], [1, 1, 1, 1, 1, 1], [0, 2, 3, 1, -1, 2]])
def test_the_three_ways_to_add_deltas_agree(monkeypatch, slots, slot_dtype):
    """Per-adapter groups, the one-hot masked matmuls, the Triton kernel (CUDA's path, here in Triton's
    interpreter) and the C++ CPU kernel add the same deltas to a projection's output; with fp32 slots, and with
    bf16 slots under fp32 activations (`--lora-dtype bfloat16`)."""
    import numpy as np
    import torch

    from hpi_kernels.cpu import cpu_kernels_available
    from hpi_runtime.lora.layers import LoRABatch, LoRAProjection, PartSlice, ProjectionShape
    from hpi_runtime.models.parallel import Span

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(0)
    shape = ProjectionShape((PartSlice("gate", 0, Span(0, 12)), PartSlice("up", 12, Span(0, 12))), None, 16, 24)
    batch = LoRABatch(4, torch.zeros(0), "torch")
    projection = LoRAProjection(shape, 4, 4, batch, getattr(torch, slot_dtype))
    assert projection.a.dtype == projection.bt.dtype == getattr(torch, slot_dtype)
    for slot in range(4):
        a_slot, bt_slot = projection.host_zeros()
        for part in ("gate", "up"):
            a, b = torch.randn(3, 16, generator=generator), torch.randn(12, 3, generator=generator)
            projection.lay_out_part(a_slot, bt_slot, part, a, b, scaling=0.5)
        projection.copy_in(slot, a_slot, bt_slot)
    x, base = torch.randn(6, 16, generator=generator), torch.randn(6, 24, generator=generator)
    token_slots = np.array(slots, dtype=np.int64)
    expected = base.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:  # the slots' values (bf16 ones exact in fp32)
            expected[t] += projection.b[:, slot].float() @ (projection.a[slot].float() @ x[t])
    # "torch": groups or one-hot, by how many slots are present; "cpu": the C++ kernel (where it builds).
    for mode in ("torch", "triton", *(("cpu",) if cpu_kernels_available() else ())):
        batch.mode = mode
        batch.set_step(token_slots, torch.device("cpu"), len(slots))
        torch.testing.assert_close(projection(None, (x,), base.clone()), expected, atol=1e-5, rtol=1e-5)
    batch.mode = "torch"
    batch.one_hot, batch.groups = None, tuple((s, torch.tensor([t for t, v in enumerate(slots) if v == s]))
                                              for s in sorted(set(slots) - {-1}))  # fmt: skip
    torch.testing.assert_close(projection(None, (x,), base.clone()), expected, atol=1e-5, rtol=1e-5)


def test_bf16_slots_under_an_fp32_model_equal_peft(tiny_model_dir, tmp_path):
    """`--lora-dtype bfloat16` under an fp32 model: an adapter saved in bf16 (as most are published) is held in
    bf16 slots, half the bytes, and loses nothing: greedy tokens and logprobs equal transformers + peft in fp32
    (peft widens the bf16 weights it loads), in a batch that mixes it with the base model; and the CPU refuses
    a dtype it does not run, naming the ones it does."""
    import torch
    from safetensors.torch import load_file, save_file

    from hpi_testing.lora_adapters import build_adapter, reference_model

    adapter = build_adapter(tiny_model_dir, tmp_path / "bf16", rank=8, seed=4)
    weights = adapter / "adapter_model.safetensors"
    save_file({key: value.bfloat16() for key, value in load_file(weights).items()}, weights)
    lora = LoRARequest("bf16", 1, str(adapter))
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32",
             lora_dtype="bfloat16", max_num_seqs=8) as llm:  # fmt: skip
        slots = next(iter(llm.engine.executor.lora.projections.values()))
        assert slots.a.dtype == slots.bt.dtype == torch.bfloat16
        prompt_ids = [llm.tokenizer(prompt).input_ids for prompt in PROMPTS[:3]] * 2
        outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0),
                               lora_request=[lora] * 3 + [None] * 3)  # fmt: skip
    references = [reference_model(tiny_model_dir, adapter), reference_model(tiny_model_dir, None)]
    for i, (ids, output) in enumerate(zip(prompt_ids, outputs, strict=True)):
        tokens, logprobs = greedy(references[i // 3], ids, MAX_TOKENS)
        assert list(output.output_token_ids) == tokens, i
        assert [entry.logprob for entry in output.new_logprobs] == pytest.approx(logprobs, abs=1e-4), i
    assert [o.output_token_ids for o in outputs[:3]] != [o.output_token_ids for o in outputs[3:]]
    with pytest.raises(ValueError, match="lora-dtype float16 under a float32 model on the CPU"):
        LLM(str(tiny_model_dir), enable_lora=True, dtype="float32", lora_dtype="float16")
