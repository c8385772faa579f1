"""The engine factory: `EngineArgs` -> one `ResolvedEngine` -> an engine, for the server and `LLM` alike.

`resolve_engine` reads the model's config.json once, checks every option against it (ValueError before a
weight is read), resolves "auto" (device, dtype, attention backend, max_model_len) and loads the tokenizer.
Its result is the one object the server, the engine-core process and the executor are built from.
`create_engine` then loads the weights in this process (the offline `LLM`); the server hands the resolved
engine to its core process instead, which loads them there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpi_kernels.cpu import cpu_kernels_available
from hpi_runtime import compile_cache, cpu_features
from hpi_runtime.config import EngineArgs, EngineConfig
from hpi_runtime.core.interface import MemoryFootprint
from hpi_runtime.core.kv_budget import kv_tokens_per_request
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.gpu_platform import current_gpu_platform, default_attention_backend, resolve_device
from hpi_runtime.host_memory import check_kv_host_bytes
from hpi_runtime.lora.layers import slot_dtype
from hpi_runtime.model_source import resolve_model_dir
from hpi_runtime.models.config import ModelConfig, load_model_config
from hpi_runtime.models.parallel import pipeline_partition, split_heads
from hpi_runtime.quantization.quantize import QuantizationConfig, resolve_activations, resolve_quantization
from hpi_runtime.spec_decode.draft_config import resolve_draft_model
from hpi_runtime.worker.executor import ExecutorConfig
from hpi_runtime.worker.factory import make_executor
from hpi_runtime.worker.pp_layout import resolve_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192  # when neither the user nor a smaller model limit says otherwise


@dataclass(frozen=True)
class ResolvedEngine:
    """Everything decided before a weight is read: the options as given, the model's config (read once),
    the core's and the executor's configs, the tokenizer. The server hands `engine_config` and
    `executor_config` to its engine-core process, which loads the weights itself."""

    args: EngineArgs
    model_config: ModelConfig
    engine_config: EngineConfig
    executor_config: ExecutorConfig
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    model_name: str
    model_dir: Path
    eos_token_ids: frozenset[int]
    quantization: str  # the method: none | int8 | int4 | a checkpoint's (gptq, awq, ...)
    quantization_scheme: str = "none"  # hpi:quantization_info's label, e.g. "int4-g32-mse-mixed", "awq-int4-g128"
    quantization_detail: str = "none"  # the start-up log's line (which linears a mixed policy keeps at int8)

    @property
    def dtype(self) -> str:
        return str(self.executor_config.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(self.executor_config.device)

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: token ids at or above it cannot be looked up."""
        return self.model_config.vocab_size

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """generation_config.json's sampling settings, the defaults for requests that leave them out."""
        return self.model_config.sampling_defaults


@dataclass(frozen=True)
class EngineBundle:
    """An engine running in this process, with what it was resolved from and what it holds in memory."""

    engine: LLMEngine
    resolved: ResolvedEngine
    footprint: MemoryFootprint


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """dtype "auto": on CPU, bf16 where the CPU has AMX, or AVX512-BF16 and the C++ kernels build; else fp32.
    On CUDA the checkpoint's 16-bit dtype, else bf16 (fp16 on GPUs without bf16).

    With AMX, torch's bf16 GEMMs are 3-5x fp32 (docs/engine.md, "dtype on CPU"). With AVX512-BF16 alone they
    run at half fp32's speed, but the C++ kernels' packed bf16 linears run at fp32's FMA rate over half the
    bytes, and the bf16 KV cache halves attention's reads: a decode step 1.7x faster than fp32 at batch 1,
    1.15x at 32 (bench/results/hot_path.md, fifth pass). Without either (AVX2: bf16 emulated), fp32."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cpu":
        if cpu_features.has_amx():
            return torch.bfloat16
        if cpu_features.has_fast_bf16() and cpu_kernels_available():
            return torch.bfloat16
        return torch.float32
    if checkpoint_dtype in ("bfloat16", "float16"):
        return DTYPES[checkpoint_dtype]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _check_lm_head_quantization(config: QuantizationConfig) -> None:
    if not config.quantize_lm_head:
        return
    if not config.enabled:
        raise ValueError("quantize_lm_head needs quantization 'int8' or 'int4', not 'none'")


def check_tensor_parallel(model_config: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError when the model cannot be split over `tensor_parallel_size` ranks (see models/parallel.py)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    for rank in range(tensor_parallel_size):
        split_heads(model_config.num_heads, model_config.num_kv_heads, tensor_parallel_size, rank)


def check_pipeline_parallel(args: EngineArgs, model_config: ModelConfig) -> None:
    """ValueError for a pipeline layout the model or the other options cannot take (worker/pp_layout.py checks the
    hosts); every host of a group runs this same check."""
    parallel = args.parallel
    layout = resolve_layout(parallel, os.environ)
    if not layout.is_distributed:
        return
    pipeline_partition(model_config, parallel.pipeline_parallel_size, os.environ)
    if args.speculative.speculative_config is not None:
        raise ValueError("speculative decoding runs with pipeline_parallel_size 1 only")
    if args.lora.enable_lora:
        raise ValueError("LoRA adapters are served with pipeline_parallel_size 1 only")
    if model_config.vision is not None:
        raise ValueError("vision-language models are served with pipeline_parallel_size 1 only")


def kv_sliding_window(model_config: ModelConfig) -> int | None:
    """The window the KV manager may free blocks behind: the widest layer's, when every layer has one."""
    windows = model_config.layer_sliding_windows
    return None if any(window is None for window in windows) else max(windows)


def resolve_max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    """The user's limit, checked against the model's positions; by default the model's, at most 8192."""
    limit = model_config.max_position_embeddings
    if requested is None:
        # Sliding-window layers attend within their window at any length: the model's positions are the limit.
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
    return requested


def resolve_engine(args: EngineArgs | None = None) -> ResolvedEngine:
    """Resolve and check everything an engine needs, short of loading the weights."""
    from transformers import AutoTokenizer

    args = args or EngineArgs()
    load, tensor_parallel_size = args.load, args.parallel.tensor_parallel_size
    model_dir, model_name = resolve_model_dir(load.model)
    model_config = load_model_config(model_dir)
    quantization_config = QuantizationConfig(load.quantization, load.quantization_group_size, load.quantize_lm_head,
                                             load.int4_fit, load.int4_policy, load.int4_activations,
                                             int8_activations=load.int8_activations,
                                             lm_head_activations=load.lm_head_activations)  # fmt: skip
    _check_lm_head_quantization(quantization_config)
    check_tensor_parallel(model_config, tensor_parallel_size)
    check_pipeline_parallel(args, model_config)
    quantization = resolve_quantization(model_dir, model_config, quantization_config, tensor_parallel_size)
    max_model_len = resolve_max_model_len(args.scheduler.max_model_len, model_config)
    engine_config = EngineConfig.resolve(args, max_model_len, kv_sliding_window(model_config),
                                         takes_images=model_config.vision is not None)
    device = resolve_device(load.device, current_gpu_platform())  # a ROCm build's GPU is device type "cuda" too
    check_kv_host_bytes(args.cache, device.type, tensor_parallel_size)  # before a core allocates what cannot fit
    compile_root = compile_cache.requested_dir(load.compile_cache_dir)
    # Before resolve_dtype: it may build the C++ kernels.
    platform_dir = compile_cache.use_for_kernels(compile_root, device) if compile_root else None
    dtype = resolve_dtype(load.dtype, device, model_config.torch_dtype)
    if args.lora.enable_lora:
        slot_dtype(args.lora.lora_dtype, dtype, device)  # a --lora-dtype the device does not run fails here
    # "auto" may build and time the C++ kernels, on the shape of the model's gate/up projection where K allows.
    gate_up = (2 * model_config.intermediate_size, model_config.hidden_size)
    quantization = resolve_activations(quantization, device, dtype,
                                       gate_up if min(gate_up) > 0 and gate_up[1] % 32 == 0 else None,
                                       tied_lm_head=model_config.tie_word_embeddings)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos_token_ids = frozenset(model_config.eos_token_ids | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    ))  # fmt: skip
    if not eos_token_ids:
        raise ValueError(f"{model_dir} defines no EOS token (config, generation_config or tokenizer)")
    spec, draft_model_config = engine_config.speculative, None
    if spec is not None and spec.method == "draft_model":
        draft_model_config = resolve_draft_model(spec.model, model_config, tokenizer, max_model_len,
                                                 tensor_parallel_size, engine_config.kv_sliding_window)  # fmt: skip
    executor_config = ExecutorConfig(
        model_config=model_config.for_max_model_len(max_model_len),  # LongRoPE picks its factors
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        cache=args.cache,
        parallel=args.parallel,
        kv_tokens_per_request=kv_tokens_per_request(
            max_model_len, engine_config.block_size, engine_config.kv_sliding_window,
            engine_config.max_num_batched_tokens,
        ),  # fmt: skip
        attention_backend=load.attention_backend if load.attention_backend != "auto" else
        default_attention_backend(device),  # fmt: skip
        seed=load.seed,
        eos_token_ids=eos_token_ids,
        quantization=quantization.config,
        enforce_eager=load.enforce_eager,
        max_num_seqs=engine_config.max_num_seqs,
        draft_model_config=draft_model_config,
        max_loras=args.lora.max_loras if args.lora.enable_lora else 0,
        max_lora_rank=args.lora.max_lora_rank,
        lora_dtype=args.lora.lora_dtype,
    )
    if platform_dir is not None:
        compile_cache.use_for_model(platform_dir, compile_cache.ModelKey(
            model_name=model_name, config_json=(model_dir / "config.json").read_bytes(), device=str(device),
            dtype=str(executor_config.dtype), quantization=quantization.scheme,
            tensor_parallel_size=tensor_parallel_size, attention_backend=executor_config.attention_backend,
            max_model_len=max_model_len,
        ))  # fmt: skip
    return ResolvedEngine(
        args=args,
        model_config=model_config,
        engine_config=engine_config,
        executor_config=executor_config,
        tokenizer=tokenizer,
        model_name=model_name,
        model_dir=model_dir,
        eos_token_ids=eos_token_ids,
        quantization=quantization.method,
        quantization_scheme=quantization.scheme,
        quantization_detail=quantization.detail,
    )


def create_engine(args: EngineArgs | None = None) -> EngineBundle:
    """Resolve `args` and build an `LLMEngine` (its core in this process) over a `LocalExecutor`
    (tensor_parallel_size 1) or a `MultiprocExecutor` (one worker process per rank; gloo on CPU, NCCL on
    CUDA devices 0..N-1)."""
    resolved = resolve_engine(args)
    executor = make_executor(resolved.executor_config)
    engine = LLMEngine(resolved.engine_config, executor, resolved.tokenizer, resolved.eos_token_ids,
                       vocab_size=resolved.vocab_size)
    return EngineBundle(engine=engine, resolved=resolved, footprint=executor.footprint)
