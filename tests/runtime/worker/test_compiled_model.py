"""The compiled model step: the same greedy tokens as the eager step (fp32 and bf16), one set of graphs
compiled at start-up for every later step shape, and `enforce_eager` really running eagerly."""

from __future__ import annotations

from pathlib import Path

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
from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor
from hpi_runtime.worker.model_runner import CompileConfig, KVCacheSpec, ModelRunner, allocate_kv_caches

from ..models.conftest import HandScheduler

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


def _generate(runner: ModelRunner, prompt_lens: list[int], num_steps: int, chunk_size: int | None = 7):
    """Greedy tokens per request over `num_steps` steps: chunked prefills, a late arrival, decodes."""
    scheduler = HandScheduler(runner.model.attention_layers()[0].k_cache.shape[0], BLOCK_SIZE, chunk_size=chunk_size)
    generator = torch.Generator().manual_seed(0)
    vocab_size = runner.model.config.vocab_size
    for i, n in enumerate(prompt_lens):
        scheduler.add(f"r{i}", torch.randint(3, vocab_size, (n,), generator=generator).tolist())
    tokens: dict[str, list[int]] = {}
    for step in range(num_steps):
        if step == 3:
            scheduler.add("late", torch.randint(3, vocab_size, (12,), generator=generator).tolist())
        for request_id, sampled in runner.execute_model(scheduler.schedule()).sampled_token_ids.items():
            for token in sampled:
                scheduler.append(request_id, token)
                tokens.setdefault(request_id, []).append(token)
    return tokens


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
    assert _generate(compiled, prompt_lens, 14) == _generate(eager, prompt_lens, 14)


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
