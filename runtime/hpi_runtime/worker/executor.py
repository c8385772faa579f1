"""LocalExecutor: the model, its paged KV cache and the runner in this process (a `ModelExecutor`).

With tensor parallelism each worker process runs one LocalExecutor over its rank's shard (see
tp_executor.py); the same class is the whole executor at tp 1. On CPU the runner compiles its model step
at start-up (each rank its own; the all-reduces trace into the graph), unless `enforce_eager`; on CUDA it
captures the decode step as CUDA graphs instead (worker/cuda_graphs.py), unless `enforce_eager`.
`sleep`/`wake_up` free and restore the KV cache and weights without touching the compiled step (worker/sleep.py);
CUDA graphs, which hold those tensors' addresses, are dropped before sleep and captured again on wake.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hpi_contracts.kv_cache import kv_bytes_per_token
from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, ParallelConfig, SchedulerConfig
from hpi_runtime.core.interface import MemoryFootprint, ModelRunnerOutput, SchedulerOutput
from hpi_runtime.core.kv_budget import num_blocks_for_budget
from hpi_runtime.lora.layers import LoRAModel
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.models.cpu_layout import choose_bf16_gemms, pack_cpu_weights, use_sgemm_layout
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.loader import load_model, weight_bytes
from hpi_runtime.models.parallel import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_model
from hpi_runtime.spec_decode.draft_model import DraftModel
from hpi_runtime.startup import PhaseClock
from hpi_runtime.worker.cuda_graphs import CudaGraphConfig, capture_sizes
from hpi_runtime.worker.host_kv_cache import HostKVCache, num_host_blocks_for_budget
from hpi_runtime.worker.model_runner import CompileConfig, KVCacheSpec, ModelRunner, allocate_kv_caches
from hpi_runtime.worker.sleep import ModelSleeper

# --kv-cache-dtype's types (vLLM's names; "fp8" is e4m3, as there); "auto" keeps the model's dtype.
KV_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}  # fmt: skip
CUDA_KV_CACHE_FRACTION = 0.85  # of the device memory still free once the weights are loaded


@dataclass(frozen=True)
class ExecutorConfig:
    """What an executor is built from: the options resolved for torch (dtype, device, backend, quantization
    plan) beside the config tree's cache and parallel sections as given (hpi_runtime/config.py)."""

    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device  # the device type; tensor-parallel rank r uses CUDA device r
    max_model_len: int
    # block_size; per rank: kv_cache_memory_bytes (None: 1 GiB on CPU, on CUDA a share of what the loaded
    # weights leave free, measured after loading so it holds for quantized weights too) and kv_offload_bytes
    # (the host-memory KV tier, host_kv_cache.py; 0 turns it off).
    cache: CacheConfig = CacheConfig()
    parallel: ParallelConfig = ParallelConfig()
    # KV token slots one request needs at once (less than max_model_len when blocks behind a sliding window
    # are freed: kv_budget.kv_tokens_per_request); None: max_model_len.
    kv_tokens_per_request: int | None = None
    attention_backend: str = "torch"  # resolved: "torch" or "triton", never "auto"
    seed: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # banned before a request's min_tokens
    quantization: QuantizationConfig = QuantizationConfig()  # weight-only int8/int4, applied after loading
    enforce_eager: bool = False  # vLLM's name: no torch.compile of the model step, no CUDA graphs
    # The scheduler's batch limit: the largest decode batch a CUDA graph is captured for.
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    # Compiled CPU step: Inductor freezing (weights as constants, prepacked for oneDNN). Off: in fp32 on the
    # CPU measured (AVX512-BF16 without AMX, 2 cores; bench/results/hot_path.md) oneDNN's prepacked linears
    # beat MKL over row-major weights at 32 rows but not over use_sgemm_layout's column-major ones, lose at
    # one row (no GEMV), and freezing keeps a second copy of the linear weights (the eager model stays
    # usable). With the C++ kernels built, fp32 linears are packed (pack_cpu_weights) and leave it nothing
    # to prepack. Never for quantized weights, which constant folding would dequantize.
    freeze_weights: bool = False
    # Draft-model speculation (spec_decode/draft_model.py): the draft, loaded beside the model in `dtype`,
    # unquantized, run eagerly. Its KV cache has as many blocks as the model's; the KV budget holds both.
    draft_model_config: ModelConfig | None = None
    # LoRA: device slots (distinct adapters per batch; 0: LoRA off) and the largest rank they hold.
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_dtype: str = "auto"  # the slots' dtype: "auto" (the activation dtype), "bfloat16" or "float16"
    # CPU decode steps as one C++ call for all layers (worker/cpu_decode.py) where the model allows it: measured
    # faster than the compiled step at every batch size tried (1-128 rows), so for every decode-only step.
    cpu_decode_stack: bool = True

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type: --kv-cache-dtype's, or the model's dtype for "auto"."""
        return KV_TORCH_DTYPES.get(self.cache.kv_cache_dtype, self.dtype)


def rank_kv_bytes_per_token(model: DecoderForCausalLM, dtype: torch.dtype) -> int:
    """K and V of one token over all layers, for the KV heads this rank holds (with tensor parallelism, a
    share of the model's that may differ between ranks or repeat a replicated head)."""
    layers = model.attention_layers()
    return sum(kv_bytes_per_token(1, attn.num_kv_heads, attn.head_dim, dtype.itemsize) for attn in layers)


def kv_budget_bytes(config: ExecutorConfig, device: torch.device) -> int:
    if config.cache.kv_cache_memory_bytes is not None:
        return config.cache.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return int(free_bytes * CUDA_KV_CACHE_FRACTION)


def compile_config(config: ExecutorConfig, device: torch.device) -> CompileConfig | None:
    """How the model step is compiled here; None: eagerly (asked for, for a vision-language model, for a pipeline
    stage, or on CUDA, whose Triton attention backend is not a compilable op yet)."""
    # A vision-language model's step takes embeddings and [3, T] positions the compiled step does not, and a
    # pipeline stage's the previous stage's hidden states as well.
    eager_model = config.model_config.vision is not None or config.parallel.pipeline_parallel_size > 1
    if config.enforce_eager or device.type != "cpu" or eager_model:
        return None
    # LoRA slots change between steps (adapters loaded at run time): nothing of theirs may become a constant.
    freeze = config.freeze_weights and not config.quantization.enabled and not config.max_loras
    return CompileConfig(max_model_len=config.max_model_len, freeze_weights=freeze)


def graph_config(config: ExecutorConfig, device: torch.device) -> CudaGraphConfig | None:
    """The decode step's CUDA graphs here; None: none (asked for, or not a CUDA device). The runner may still
    decline them for a model it cannot capture (cuda_graphs.graphs_unsafe_reason)."""
    if config.enforce_eager or device.type != "cuda":
        return None
    return CudaGraphConfig(sizes=capture_sizes(config.max_num_seqs), max_model_len=config.max_model_len)


def cpu_decode_rows(config: ExecutorConfig, device: torch.device) -> int:
    """The most tokens of a decode step the runner's CPU DecodeStack runs (worker/cpu_decode.py): every decode-only
    step (max_num_seqs); 0: none (turned off, --enforce-eager, not a CPU device, or a vision-language model's image
    inputs). The runner may still decline it for a model the stack cannot run (cpu_decode.unsupported_reason)."""
    image_inputs = config.model_config.vision is not None
    if not config.cpu_decode_stack or config.enforce_eager or device.type != "cpu" or image_inputs:
        return 0
    return config.max_num_seqs  # the most decodes one step holds


def _build_model(
    config: ExecutorConfig, device: torch.device, backend: AttentionBackend, tp: TensorParallel,
    clock: PhaseClock | None = None, stage: PipelineStage = SINGLE_STAGE,
) -> DecoderForCausalLM:
    """The weights as served: loaded, quantized, laid out for the CPU. Start-up and a wake from sleep level 2
    both call this, so the woken weights are the start-up ones, byte for byte."""
    clock = clock or PhaseClock()

    def after_layer(model: DecoderForCausalLM, layer: str | None) -> None:
        """Each layer as it is loaded: quantized, then (CPU) packed, so the float model is never whole in memory
        (an fp32 model from a bf16 checkpoint keeps its linears in bf16 panels: half the bytes)."""
        if config.quantization.enabled:
            with clock("quantize"):
                quantize_model(model, config.quantization, layer)
        if device.type == "cpu" and layer is not None:
            with clock("layout"):
                pack_cpu_weights(model.get_submodule(layer))

    layer_by_layer = config.quantization.enabled or device.type == "cpu"
    nested = {phase: clock.phases.get(phase, 0.0) for phase in ("quantize", "layout")}
    with clock("load"):
        model = load_model(config.model_config, config.dtype, device, backend, tp, stage,
                           after_layer if layer_by_layer else None)  # fmt: skip
    clock.phases["load"] -= sum(clock.phases.get(p, 0.0) - s for p, s in nested.items())  # phases add up to the whole
    with clock("layout"):  # the rest: the LM head (and an embedding tied to it), or MKL's layout without the kernels
        pack_cpu_weights(model) or use_sgemm_layout(model)
        if device.type == "cpu":
            choose_bf16_gemms(config.dtype)
    return model


class LocalExecutor:
    def __init__(
        self, config: ExecutorConfig, tp: TensorParallel = SINGLE, device: torch.device | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:  # fmt: skip
        """`tp`, `stage`: this process's tensor-parallel rank and pipeline stage (worker processes pass them)."""
        self.config = config
        device = device or config.device
        model_config = config.model_config
        backend = get_attention_backend(config.attention_backend, config.dtype, device)
        clock = PhaseClock()  # start-up phases (hpi_runtime/startup.py), reported through CoreInfo
        self.model = _build_model(config, device, backend, tp, clock, stage)
        draft = None
        if config.draft_model_config is not None:
            draft_config = replace(config, model_config=config.draft_model_config, quantization=QuantizationConfig())
            with clock("draft"):
                draft = _build_model(draft_config, device, backend, tp)
        kv_started = time.perf_counter()
        kv_models = [self.model] if draft is None else [self.model, draft]
        # Every rank of every stage must hold the same blocks (each stage's for its own layers): take the count
        # the tightest rank affords.
        self._num_kv_blocks = stage.min_int(tp.min_int(
            num_blocks_for_budget(
                kv_budget_bytes(config, device),
                sum(rank_kv_bytes_per_token(model, config.kv_dtype) for model in kv_models),
                config.cache.block_size,
                config.kv_tokens_per_request or config.max_model_len,
            )
        ))
        kv_spec = KVCacheSpec(self._num_kv_blocks, config.cache.block_size, config.kv_dtype)
        kv_cache_bytes = sum(allocate_kv_caches(model, kv_spec, device) for model in kv_models)
        block_bytes = rank_kv_bytes_per_token(self.model, config.kv_dtype) * config.cache.block_size
        self._num_host_kv_blocks = stage.min_int(tp.min_int(
            num_host_blocks_for_budget(config.cache.kv_offload_bytes, block_bytes)))
        self.host_kv_cache = None
        if self._num_host_kv_blocks:
            self.host_kv_cache = HostKVCache(self.model, self._num_host_kv_blocks, device)
        clock.phases["kv_cache"] = time.perf_counter() - kv_started
        self.footprint = MemoryFootprint(
            weight_bytes=sum(weight_bytes(model) for model in (self.model, draft) if model is not None),
            kv_cache_bytes=kv_cache_bytes,
            num_kv_blocks=self._num_kv_blocks,
            block_size=config.cache.block_size,
            host_kv_cache_bytes=0 if self.host_kv_cache is None else self.host_kv_cache.num_bytes,
            num_host_kv_blocks=self._num_host_kv_blocks,
        )
        eos_token_ids = config.eos_token_ids or model_config.eos_token_ids
        drafter = None if draft is None else DraftModel(draft, backend, config.cache.block_size, config.seed)
        self.lora = None
        if config.max_loras:
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank, tp, config.lora_dtype)
        with clock("compile"):
            self.runner = ModelRunner(self.model, backend, config.cache.block_size, eos_token_ids, config.seed,
                                      compile_config(config, device), drafter, self.lora,
                                      graph_config(config, device), cpu_decode_rows(config, device))  # fmt: skip
        self.startup = dict(clock.phases)
        self.sleeper = ModelSleeper(self.model, lambda: _build_model(config, device, backend, tp, stage=stage))

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def num_host_kv_blocks(self) -> int:
        return self._num_host_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.lora_updates:
            self.lora.apply(scheduler_output.lora_updates)
        if scheduler_output.kv_transfers:
            self.host_kv_cache.apply(scheduler_output.kv_transfers)
        # Also a step of block copies alone: the runner still takes its finished and preempted requests out.
        output = self.runner.execute_model(scheduler_output)
        if self.lora is not None and (ready := self.lora.take_ready()):
            output = replace(output, lora_ready=ready)
        return output

    def sleep(self, level: int) -> int:
        """Release the KV cache (and the weights, per `level`: worker/sleep.py); returns the bytes freed."""
        self.runner.release_graphs()  # they would replay over the freed addresses
        return self.sleeper.sleep(level)

    def wake_up(self) -> int:
        """Restore what `sleep` released; returns the bytes restored."""
        restored = self.sleeper.wake_up()
        self.runner.capture_graphs()  # the restored storages sit at new addresses
        return restored

    def stage_busy_s(self) -> tuple[float, ...]:
        return ()  # one pipeline stage

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Nothing outside this process can fail under it; a failing step raises from execute_model."""

    def shutdown(self) -> None:
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.host_kv_cache = None
        self.runner.input_batch.clear()
        if self.lora is not None:
            self.lora.shutdown()
