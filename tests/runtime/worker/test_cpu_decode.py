"""The CPU DecodeStack (worker/cpu_decode.py, kernels' decode_stack.cpp): decode steps through it give the eager
model's tokens and hidden states for every linear kind (packed fp32/bf16, unpacked, int8, int4), with biases, a
sliding window and a soft-cap, and LoRA adapters' deltas by each token's slot; steps it does not take (prefill
chunks) and models it cannot run go through the model's own ops; bad inputs are ValueErrors; a sleep drops it and
a wake rebuilds it over the new caches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpi_kernels.cpu import cpu_kernels_available
from hpi_runtime.attention.op import PagedAttentionInputs, PagedAttentionOpBackend
from hpi_runtime.config import CacheConfig
from hpi_runtime.lora.layers import LoRAModel
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.cpu_layout import pack_cpu_weights
from hpi_runtime.models.loader import load_model
from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_model
from hpi_runtime.worker.cpu_decode import CpuDecodeStack, _linear_args, build_stack, unsupported_reason
from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.model_runner import KVCacheSpec, ModelRunner, allocate_kv_caches

from .test_compiled_model import BF16_NEAR_TIE_NATS, _assert_same_up_to_near_ties, _generate

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels did not build here")

NUM_BLOCKS, BLOCK_SIZE = 96, 8
NO_LORA = torch.empty(0, dtype=torch.long)  # DecodeStack.forward's lora_slots for a step without adapters


def _model(model_dir: Path, dtype: torch.dtype, quantization: str = "none", pack: bool = True,
           kv_dtype: torch.dtype | None = None, cpu_attention: bool = True):  # fmt: skip
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    # cpu_attention=False: the reference attention (gather + SDPA) instead of the C++ kernel.
    backend = PagedAttentionOpBackend(dtype, prefer_cpu_kernel=cpu_attention)
    model = load_model(config, dtype, cpu, backend)
    # "int4" / "int8" run the float-activation ops, "int4-a8" / "int8-a8" W4A8 / W8A8 (int4_a8_linear,
    # int8_a8_linear), whatever this CPU's default; "-a8upto2" x in int8 up to 2 rows and the
    # float tiles above (as "auto" where those measure faster); "int4-a8-int8a8" int4's int8 q/k/v in W8A8 too.
    method, _, a8 = quantization.partition("-")
    a8, _, int8_layers = a8.partition("-")
    rows = int(a8.removeprefix("a8upto")) if a8.startswith("a8upto") else -1
    activations = "int8" if a8 else "float"
    int8_activations = activations if method == "int8" or int8_layers else "float"
    quantize_model(model, QuantizationConfig(method=method, int4_activations=activations, int4_a8_max_rows=rows,
                                             int8_activations=int8_activations, int8_a8_max_rows=rows))  # fmt: skip
    if pack:
        pack_cpu_weights(model)
    allocate_kv_caches(model, KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, kv_dtype or dtype), cpu)
    return model, backend


def _runner(model_dir: Path, dtype: torch.dtype, stack_rows: int, quantization: str = "none",
            pack: bool = True, **model_options: Any) -> ModelRunner:  # fmt: skip
    model, backend = _model(model_dir, dtype, quantization, pack, **model_options)
    config = load_model_config(model_dir)
    return ModelRunner(model, backend, BLOCK_SIZE, config.eos_token_ids, 0, cpu_decode_rows=stack_rows)


@pytest.mark.parametrize(
    ("arch", "overrides", "quantization", "pack"),
    [
        ("llama", {}, "none", True),
        ("llama", {}, "none", False),  # weights left unpacked: at::linear
        ("llama", {"dtype": "bfloat16"}, "none", True),  # a bf16 checkpoint in fp32: bf16 panels, fp32 x
        ("llama", {}, "int8", True),
        ("llama", {}, "int8-a8", True),  # W8A8
        ("llama", {}, "int8-a8upto2", True),
        ("llama", {}, "int4", True),
        ("llama", {}, "int4-a8", True),  # W4A8: x quantized to int8 per group in the stack as in the model
        ("llama", {}, "int4-a8-int8a8", True),  # and the int8 q/k/v in W8A8
        ("llama", {}, "int4-a8upto2", True),  # and the float tiles for steps of 3-4 rows, in both
        ("qwen2", {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 1}, "none", True),  # q/k/v biases
        ("mistral", {"sliding_window": 6}, "none", True),
        ("phi3", {"partial_rotary_factor": 0.5}, "none", True),  # half of each head rotated
        ("qwen3", {}, "none", True),  # per-head q/k norms (random weights)
        ("gemma2", {}, "none", True),  # sandwich norms, GELU-tanh, soft-caps, alternating windows, unit offsets
        ("gemma3", {}, "int4", True),  # and a second RoPE table for the sliding-window layers
    ],
    ids=["packed", "unpacked", "bf16-checkpoint", "int8", "int8-a8", "int8-a8-up-to-2-rows", "int4", "int4-a8",
         "int4-a8-int8-q-k-v-a8", "int4-a8-up-to-2-rows", "qwen2-bias", "mistral-window", "phi3-partial-rotary",
         "qwen3-qk-norm", "gemma2", "gemma3-int4"],
)
def test_decode_steps_through_the_stack_give_the_eager_tokens(tiny_model_factory, arch, overrides, quantization,
                                                               pack) -> None:  # fmt: skip
    """fp32, greedy: token for token the eager model's, over chunked prefills (which the stack does not take), a
    late arrival and up to four requests decoding together."""
    model_dir = tiny_model_factory(arch, **overrides)
    reference = _runner(model_dir, torch.float32, 0, quantization, pack)
    runner = _runner(model_dir, torch.float32, 64, quantization, pack)
    assert reference.cpu_decode is None
    prompt_lens = [5, 19, 1, 33]
    assert _generate(runner, prompt_lens, 16) == _generate(reference, prompt_lens, 16)
    assert runner.cpu_decode.steps >= 6  # the decode-only steps after the last prefill chunk (5 requests)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_decode_steps_over_a_converted_cache_give_the_reference_tokens(tiny_model_dir: Path, kv_dtype) -> None:
    """`--kv-cache-dtype fp8*` and `bfloat16` under an fp32 model: the stack writes and reads the narrower cache
    (through the C++ attention) as the eager model with the reference attention (gather + SDPA over the widened
    cache) does, token for token."""
    reference = _runner(tiny_model_dir, torch.float32, 0, kv_dtype=kv_dtype, cpu_attention=False)
    runner = _runner(tiny_model_dir, torch.float32, 64, kv_dtype=kv_dtype)
    prompt_lens = [5, 19, 1, 33]
    assert _generate(runner, prompt_lens, 16) == _generate(reference, prompt_lens, 16)
    assert runner.cpu_decode.steps >= 6
    assert runner.model.attention_layers()[0].k_cache.dtype == kv_dtype


def test_bf16_tokens_match_up_to_near_ties(tiny_model_dir: Path) -> None:
    reference = _runner(tiny_model_dir, torch.bfloat16, 0)
    runner = _runner(tiny_model_dir, torch.bfloat16, 64)
    prompt_lens = [5, 19, 1, 33]
    logprobs: dict[str, list[Any]] = {}
    expected = _generate(reference, prompt_lens, 16, logprobs=logprobs)
    ties = _assert_same_up_to_near_ties(_generate(runner, prompt_lens, 16), expected, logprobs, BF16_NEAR_TIE_NATS)
    assert ties <= 1, f"{ties} of {len(expected)} requests parted at near-ties: more than bf16 explains"


def _decode_inputs(num_reqs: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One decode token per request, request r's context in blocks r * blocks_per_req ...: ids, positions and the
    attention inputs, with the earlier context's K/V already in the caches (random)."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    input_ids = torch.randint(3, 300, (num_reqs,), generator=generator)
    positions = torch.full((num_reqs,), context - 1, dtype=torch.int64)
    block_tables = torch.arange(num_reqs * blocks_per_req, dtype=torch.int32).view(num_reqs, blocks_per_req)
    slot_mapping = block_tables[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    context_lens = torch.full((num_reqs,), context, dtype=torch.int32)
    return input_ids, positions, slot_mapping, block_tables, query_start_loc, context_lens


HIDDEN_STATE_MODELS = {  # arch, config overrides, attention soft-cap set on every layer afterwards
    "mistral-window-softcap": ("mistral", {"sliding_window": 5, "num_layers": 3}, 4.0),
    # sandwich norms, GELU-tanh, unit-offset norms, its own soft-caps and query scale, alternating windows
    "gemma2": ("gemma2", {"sliding_window": 5, "num_layers": 3}, None),
    # and the sliding-window layers' own RoPE table (layer 5 of 6 global)
    "gemma3": ("gemma3", {"sliding_window": 5, "num_layers": 6, "rope_local_base_freq": 100.0}, None),
    # SiLU x up over whole vectors of 32 bf16 values and a row's 8-value tail (72 = 2 x 32 + 8)
    "llama-ffn-tail": ("llama", {"intermediate_size": 72, "num_layers": 2}, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_reqs", [1, 7, 40])  # 40 x 64 elements: the element-wise loops split over threads
@pytest.mark.parametrize("name", list(HIDDEN_STATE_MODELS))
def test_hidden_states_are_the_eager_models(tiny_model_factory, name: str, dtype: torch.dtype, num_reqs: int) -> None:
    """The stack's output and KV writes against the eager forward over the same random caches."""
    arch, overrides, softcap = HIDDEN_STATE_MODELS[name]
    model, _ = _model(tiny_model_factory(arch, **overrides), dtype)
    for attn in model.attention_layers():
        attn.logit_softcap = softcap or attn.logit_softcap
    assert unsupported_reason(model, dtype, True) is None
    generator = torch.Generator().manual_seed(num_reqs)
    caches = [(a.k_cache, a.v_cache) for a in model.attention_layers()]
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    saved = [(k.clone(), v.clone()) for k, v in caches]
    ids, positions, slots, tables, starts, lens = _decode_inputs(num_reqs, 13, generator)
    metadata = PagedAttentionInputs(slots, tables, starts, lens)
    with torch.inference_mode():
        expected = model(ids, positions, metadata)
        expected_caches = [(k.clone(), v.clone()) for k, v in caches]
        for (k, v), (k0, v0) in zip(caches, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        got = CpuDecodeStack(model, 64)
        got.build()
        hidden = got(ids, positions, metadata)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(hidden, expected, **tolerance)
    for (k, v), (ek, ev) in zip(caches, expected_caches, strict=True):
        torch.testing.assert_close(k, ek, **tolerance)
        torch.testing.assert_close(v, ev, **tolerance)


def test_models_it_cannot_run_say_why_and_decode_through_their_own_ops(tiny_model_factory) -> None:
    mixtral = tiny_model_factory("mixtral")
    model, _ = _model(mixtral, torch.float32)
    assert "MLP" in unsupported_reason(model, torch.float32, True)  # Mixture-of-Experts
    llama, _ = _model(tiny_model_factory("llama"), torch.float32)
    assert "attention" in unsupported_reason(llama, torch.float32, False)
    runner = _runner(mixtral, torch.float32, 64)
    assert runner.cpu_decode is None
    assert _generate(runner, [4, 9], 5) == _generate(_runner(mixtral, torch.float32, 0), [4, 9], 5)


def test_bad_inputs_are_value_errors(tiny_model_dir: Path) -> None:
    model, _ = _model(tiny_model_dir, torch.float32)
    stack = build_stack(model)
    generator = torch.Generator().manual_seed(0)
    ids, positions, slots, tables, starts, lens = _decode_inputs(2, 9, generator)
    hidden = model.model.embed(ids)
    with pytest.raises(ValueError, match="past the RoPE table"):
        stack.forward(hidden, torch.tensor([3, 10_000]), slots, tables, starts, lens, NO_LORA)
    with pytest.raises(ValueError, match="hidden must be"):
        stack.forward(hidden[:, :10], positions, slots, tables, starts, lens, NO_LORA)
    with pytest.raises(ValueError, match="dtype"):
        stack.forward(hidden.bfloat16(), positions, slots, tables, starts, lens, NO_LORA)
    with pytest.raises(ValueError, match="outside the cache"):
        stack.forward(hidden, positions, slots + 10**9, tables, starts, lens, NO_LORA)
    with pytest.raises(ValueError, match="lora_slots must be"):
        stack.forward(hidden, positions, slots, tables, starts, lens, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="four linears"):
        build_stack(model).add_layer(*([model.model.norm.weight] * 2), model.attention_layers()[0].k_cache,
                                     model.attention_layers()[0].v_cache, 1.0, 0, 0.0)  # fmt: skip
    with pytest.raises(ValueError, match="q_norm must be"):
        stack.set_head_norms(torch.ones(7), torch.ones(7))
    fresh = build_stack(model)
    with pytest.raises(ValueError, match="set_lora follows"):
        fresh.set_lora(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), [0, 8], None)
    qkv = model.model.layers[0].self_attn.qkv_proj
    fresh.add_linear(*_linear_args(qkv))
    with pytest.raises(ValueError, match="LoRA slots must be"):  # B's outputs are not the linear's
        fresh.set_lora(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), [0, 8], None)


def test_sleep_drops_the_stack_and_a_wake_rebuilds_it_over_the_new_caches(tiny_model_dir: Path) -> None:
    config = ExecutorConfig(model_config=load_model_config(tiny_model_dir), dtype=torch.float32,
                            device=torch.device("cpu"), max_model_len=64,
                            cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 20))  # fmt: skip
    executor = LocalExecutor(config)
    runner = executor.runner
    assert runner.cpu_decode is not None and runner.cpu_decode.takes(1, 1, (0,))
    before = _generate(runner, [5, 9], 6)
    runner.input_batch.clear()
    executor.sleep(1)
    assert not runner.cpu_decode.takes(1, 1, (0,))  # holds no cache any more: steps go through the model's ops
    executor.wake_up()
    assert runner.cpu_decode.takes(1, 1, (0,))
    steps = runner.cpu_decode.steps
    assert _generate(runner, [5, 9], 6) == before
    assert runner.cpu_decode.steps > steps


@pytest.mark.parametrize(("dtype", "quantization"),
                         [(torch.float32, "none"), (torch.float32, "int8"), (torch.float32, "int4-a8"),
                          (torch.bfloat16, "none")], ids=["fp32", "int8", "int4-a8", "bf16"])  # fmt: skip
def test_lora_deltas_in_the_stack_are_the_hooks(tiny_model_dir: Path, dtype: torch.dtype, quantization: str) -> None:
    """LoRA slots registered with the stack: each token's delta by its slot (-1: none), over float, int8 and W4A8
    base linears, as the model's hooks add it in their torch-ops form (the reference, not the C++ kernel)."""
    model, _ = _model(tiny_model_dir, dtype, quantization)
    lora = LoRAModel(model, num_slots=3, max_rank=4, tp=model.model.tp)
    generator = torch.Generator().manual_seed(1)
    for projection in lora.projections.values():
        for slot in range(3):
            a_slot, bt_slot = projection.host_zeros()
            for part in projection.parts:
                a = torch.randn(4, projection.a.shape[2], generator=generator) * 0.2
                b = torch.randn(part.rows.size, 4, generator=generator) * 0.2
                projection.lay_out_part(a_slot, bt_slot, part.name, a, b, scaling=0.5)
            projection.copy_in(slot, a_slot, bt_slot)
    num_reqs = 6
    ids, positions, slots, tables, starts, lens = _decode_inputs(num_reqs, 13, generator)
    token_slots = np.array([0, -1, 2, 0, 1, -1], dtype=np.int64)
    metadata = PagedAttentionInputs(slots, tables, starts, lens)
    caches = [(a.k_cache, a.v_cache) for a in model.attention_layers()]
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    saved = [(k.clone(), v.clone()) for k, v in caches]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        lora.batch.mode = "torch"
        lora.batch.set_step(token_slots, cpu, num_reqs)
        expected = model(ids, positions, metadata)
        for (k, v), (k0, v0) in zip(caches, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        lora.batch.mode = "cpu"
        lora.batch.set_step(token_slots, cpu, num_reqs)
        stack = CpuDecodeStack(model, 64, lora)
        stack.build()
        got = stack(ids, positions, metadata)
        for (k, v), (k0, v0) in zip(caches, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        lora.batch.set_step(None, cpu, num_reqs)  # no adapter in the step
        without = stack(ids, positions, metadata)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(got, expected, **tolerance)
    base = torch.from_numpy(token_slots < 0)
    torch.testing.assert_close(without[base], got[base], atol=0, rtol=0)  # base-model rows: no delta
    assert (without[~base] - got[~base]).abs().amax() > 0.1  # the adapted rows' deltas are really there
