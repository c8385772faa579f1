"""The compiled model step: the same greedy tokens as the eager step (fp32 and bf16), one set of graphs
compiled at start-up for every later step shape, and `enforce_eager` really running eagerly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.config import CacheConfig
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.cpu_layout import pack_cpu_weights, use_sgemm_layout
from hpi_runtime.models.loader import load_model
from hpi_runtime.quantization.linear import CPU_INT8_DEQUANT_MIN_ROWS
from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_model
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.model_runner import CompileConfig, KVCacheSpec, ModelRunner, allocate_kv_caches

from ..models.conftest import GREEDY, HandScheduler

pytestmark = pytest.mark.slow  # each compiled runner compiles a 2-layer model (seconds)

NUM_BLOCKS, BLOCK_SIZE = 96, 8


def _runner(
    model_dir: Path,
    dtype: torch.dtype,
    compiled: bool,
    freeze_weights: bool = False,
    num_blocks: int = NUM_BLOCKS,
    quantization: str = "none",
    seal: bool = True,
) -> ModelRunner:
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    backend = get_attention_backend("torch", dtype, cpu)
    model = load_model(config, dtype, cpu, backend)
    quantize_model(model, QuantizationConfig(method=quantization))
    # As the executor lays weights out; frozen weights keep F.linear (MKL's layout), which freezing prepacks.
    if freeze_weights or not pack_cpu_weights(model):
        use_sgemm_layout(model)
    allocate_kv_caches(model, KVCacheSpec(num_blocks, BLOCK_SIZE, dtype), cpu)
    compile_config = CompileConfig(max_model_len=128, freeze_weights=freeze_weights, seal_after_warmup=seal)
    compile_config = compile_config if compiled else None
    return ModelRunner(model, backend, BLOCK_SIZE, config.eos_token_ids, 0, compile_config)


GREEDY_TOP2 = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)  # the two best tokens (the chosen one first)
# Where a bf16 step may pick either of two tokens: compiled and eager steps sum in different orders (inductor's
# fusions), so their bf16 hidden states differ in the last bits, and the LM head's fp32 logits (not rounded to
# bf16, which used to turn such near-ties into exact ties both sides broke alike) follow them. A gap of 0.05
# nats is a few bf16 steps of a hidden state's contribution at these logits' scale.
BF16_NEAR_TIE_NATS = 0.05


def _generate(runner: ModelRunner, prompt_lens: list[int], num_steps: int, chunk_size: int | None = 7,
              logprobs: dict[str, list[Any]] | None = None):  # fmt: skip
    """Greedy tokens per request over `num_steps` steps: chunked prefills, a late arrival, decodes.
    `logprobs`: filled with each sampled token's logprobs (and its runner-up's)."""
    scheduler = HandScheduler(runner.model.attention_layers()[0].k_cache.shape[0], BLOCK_SIZE, chunk_size=chunk_size)
    generator = torch.Generator().manual_seed(0)
    vocab_size = runner.model.config.vocab_size
    params = GREEDY_TOP2 if logprobs is not None else GREEDY
    for i, n in enumerate(prompt_lens):
        scheduler.add(f"r{i}", torch.randint(3, vocab_size, (n,), generator=generator).tolist(), params)
    tokens: dict[str, list[int]] = {}
    for step in range(num_steps):
        if step == 3:
            scheduler.add("late", torch.randint(3, vocab_size, (12,), generator=generator).tolist(), params)
        output = runner.execute_model(scheduler.schedule())
        for request_id, sampled in output.sampled_token_ids.items():
            for token in sampled:
                scheduler.append(request_id, token)
                tokens.setdefault(request_id, []).append(token)
            if logprobs is not None:
                logprobs.setdefault(request_id, []).extend(output.logprobs.get(request_id, ()))
    return tokens


def _assert_same_up_to_near_ties(compiled: dict[str, list[int]], eager: dict[str, list[int]],
                                 eager_logprobs: dict[str, list[Any]], tie_nats: float) -> int:  # fmt: skip
    """The compiled tokens are the eager ones, except that a request may part ways at a step where the eager run's
    two best tokens were within `tie_nats` and the compiled run took the runner-up (what follows then has other
    context, so it is not compared); returns the number of such near-ties."""
    assert compiled.keys() == eager.keys()
    ties = 0
    for request_id, expected in eager.items():
        got = compiled[request_id]
        assert len(got) == len(expected)
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
        if first is None:
            continue
        chosen = eager_logprobs[request_id][first]
        runner_up = dict(chosen.top).get(got[first])
        assert runner_up is not None, f"{request_id} step {first}: compiled took {got[first]}, not eager's runner-up"
        assert chosen.logprob - runner_up <= tie_nats, (
            f"{request_id} step {first}: compiled took {got[first]} though eager preferred {expected[first]} by "
            f"{chosen.logprob - runner_up:.3f} nats")  # fmt: skip
        ties += 1
    return ties


@pytest.mark.parametrize(
    ("dtype", "freeze_weights"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "fp32-frozen-weights"],
)
def test_compiled_step_generates_the_eager_tokens(tiny_model_dir: Path, dtype: torch.dtype, freeze_weights) -> None:
    eager = _runner(tiny_model_dir, dtype, compiled=False)
    packed_before = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    compiled = _runner(tiny_model_dir, dtype, compiled=True, freeze_weights=freeze_weights)
    assert compiled.is_compiled and not eager.is_compiled
    # Frozen weights are prepacked for oneDNN (all 4 linears of both layers), unfrozen ones never are.
    packed = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] - packed_before
    assert packed == (8 if freeze_weights else 0)
    prompt_lens = [5, 19, 1, 33]
    if dtype == torch.float32:
        assert _generate(compiled, prompt_lens, 14) == _generate(eager, prompt_lens, 14)
        return
    eager_logprobs: dict[str, list[Any]] = {}
    eager_tokens = _generate(eager, prompt_lens, 14, logprobs=eager_logprobs)
    ties = _assert_same_up_to_near_ties(_generate(compiled, prompt_lens, 14), eager_tokens, eager_logprobs,
                                        BF16_NEAR_TIE_NATS)  # fmt: skip
    assert ties <= 1, f"{ties} of {len(eager_tokens)} requests parted at near-ties: more than bf16 explains"


def test_int8_layers_choose_by_step_size_inside_one_graph(tiny_model_dir: Path) -> None:
    """fp32 activations over int8 weights dequantize the layer for steps of CPU_INT8_DEQUANT_MIN_ROWS rows
    or more: a `torch.cond` on the unbacked row count, so small and large steps share one graph and the
    compiled tokens stay the eager ones on both sides of the threshold. (That is torch's-ops fallback; where
    the C++ CPU kernels build, the layer is one opaque op, hpi_kernels' int8 panels, which choose inside: the
    same assertions hold.)"""
    long_prompt = CPU_INT8_DEQUANT_MIN_ROWS + 40  # its one-step prefill takes the dequantized branch
    eager = _runner(tiny_model_dir, torch.float32, compiled=False, num_blocks=160, quantization="int8")
    compiled = _runner(tiny_model_dir, torch.float32, compiled=True, num_blocks=160, quantization="int8", seal=False)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens = _generate(compiled, [long_prompt, 6], 6, chunk_size=None)
    assert counters["stats"]["unique_graphs"] == graphs
    assert tokens == _generate(eager, [long_prompt, 6], 6, chunk_size=None)


def test_no_recompilation_across_step_shapes(tiny_model_dir: Path) -> None:
    """After start-up, batches of 1..64 requests, single decodes and mixed prefill/decode steps reuse the
    warm-up's one graph: any recompilation raises. Guards stay evaluated here (not sealed): this is what
    makes skipping them in a served engine sound."""
    before = counters["stats"]["unique_graphs"]
    runner = _runner(tiny_model_dir, torch.float32, compiled=True, num_blocks=160, seal=False)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        _generate(runner, [3], 4, chunk_size=None)  # one request: 1-token decodes (a size of 1, not specialised)
        runner.input_batch.clear()
        _generate(runner, [1 + (i * 7) % 9 for i in range(63)], 5, chunk_size=None)  # up to 64 requests
        runner.input_batch.clear()
        _generate(runner, [50, 2, 9], 8, chunk_size=5)  # chunked prefills next to decodes
    assert counters["stats"]["unique_graphs"] == graphs


def _executor(model_dir: Path, enforce_eager: bool) -> LocalExecutor:
    config = ExecutorConfig(model_config=load_model_config(model_dir), dtype=torch.float32, device=torch.device("cpu"),
                            max_model_len=64, cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 20),
                            enforce_eager=enforce_eager)  # fmt: skip
    return LocalExecutor(config)


def test_enforce_eager_runs_without_dynamo(tiny_model_dir: Path) -> None:
    frames = counters["stats"]["calls_captured"], counters["frames"]["total"]
    executor = _executor(tiny_model_dir, enforce_eager=True)
    assert not executor.runner.is_compiled
    _generate(executor.runner, [5, 9], 4)
    assert (counters["stats"]["calls_captured"], counters["frames"]["total"]) == frames  # Dynamo never ran
    assert _executor(tiny_model_dir, enforce_eager=False).runner.is_compiled  # the default compiles


def test_each_model_has_its_own_graphs(tiny_model_dir: Path, tiny_model_factory) -> None:
    """Dynamo's recompile limit counts per code object: models compiled in one process (tests, notebooks)
    must not share one, or the ninth model's compile fails. The second model's head_dim of 8 is one the
    C++ kernel does not take: the op's reference path, compiled."""
    other_dir = tiny_model_factory("qwen2", hidden_size=24, num_heads=3, num_kv_heads=1)
    with torch._dynamo.config.patch(recompile_limit=1):
        first = _runner(tiny_model_dir, torch.float32, compiled=True)
        second = _runner(other_dir, torch.float32, compiled=True)
        assert _generate(first, [4, 9], 3)
        assert _generate(second, [4, 9], 6) == _generate(_runner(other_dir, torch.float32, compiled=False), [4, 9], 6)
