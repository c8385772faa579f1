"""The offline API (`LLM.generate` / `LLM.chat`, like vLLM's) and `create_engine`, which the server uses too.

`model=None` means the embedded SmolLM2-135M-Instruct (converted once into the cache directory); any
local Hugging Face directory works, and a Hub id when the network allows.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hpi_kernels.cpu import cpu_kernels_available
from hpi_runtime import cpu_features
from hpi_runtime.config import EngineConfig
from hpi_runtime.core.interface import TokenLogprobs
from hpi_runtime.core.kv_budget import kv_tokens_per_request
from hpi_runtime.frontend.engine import LLMEngine, QueueFullError
from hpi_runtime.models.config import ModelConfig, load_model_config
from hpi_runtime.models.parallel import split_heads
from hpi_runtime.outputs import RequestOutput, RequestOutputKind
from hpi_runtime.quantization.policy import DEFAULT_INT4_POLICY
from hpi_runtime.quantization.quantize import DEFAULT_INT4_GROUP_SIZE, QuantizationConfig, resolve_quantization
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.executor import ExecutorConfig
from hpi_runtime.worker.factory import make_executor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192  # when neither the user nor a smaller model limit says otherwise

Message = dict[str, str]


@dataclass(frozen=True)
class EngineBundle:
    """An engine with everything the serving edge needs to know about what it runs."""

    engine: LLMEngine
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    model_name: str
    model_dir: Path
    max_model_len: int
    eos_token_ids: frozenset[int]
    dtype: str
    device: str
    weight_bytes: int
    kv_cache_bytes: int
    num_kv_blocks: int
    quantization: str = "none"
    vocab_size: int = 0  # rows of the model's embedding: token ids at or above it cannot be looked up
    # generation_config.json's sampling settings, the defaults for requests that leave them out
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    quantization_scheme: str = "none"  # see PreparedEngine


def resolve_model_dir(model: str | Path | None) -> tuple[Path, str]:
    """(local directory, served model name) for `model`: None -> embedded, a directory, or a Hub id."""
    if model is None:
        from hpi_runtime.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model

        return ensure_embedded_model(), EMBEDDED_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return path, path.name
    if isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            return download_from_hub(model), model
        except Exception as exc:  # offline, unknown id, gated: all mean "cannot get it"
            raise FileNotFoundError(f"{model!r} is not a local directory and could not be downloaded: {exc}") from exc
    raise FileNotFoundError(f"model directory {str(path)!r} does not exist")


def download_from_hub(model_id: str, local_dir: Path | None = None, revision: str = "main") -> Path:
    """Fetch a Hub model's configs and tokenizer, then only the weight files the loader will read, verified
    and resumable (hpi_runtime/download.py), into `local_dir` or `$HF_HOME/hpi-models/<id>/<revision>`.
    HF_TOKEN and HF_ENDPOINT are honoured."""
    from huggingface_hub import constants

    from hpi_runtime.download import download_model

    target = local_dir if local_dir is not None else Path(constants.HF_HOME) / "hpi-models" / model_id / revision
    return download_model(model_id, target, revision).local_dir


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """dtype "auto": on CPU, bf16 where the CPU has AMX, or AVX512-BF16 and the C++ kernels build; else fp32.
    On CUDA the checkpoint's 16-bit dtype, else bf16 (fp16 on GPUs without bf16).

    With AMX, torch's bf16 GEMMs are 3-5x fp32 (DESIGN.md). With AVX512-BF16 alone they run at half fp32's
    speed, but the C++ kernels' packed bf16 linears run at fp32's FMA rate over half the bytes, and the bf16
    KV cache halves attention's reads: a decode step 1.7x faster than fp32 at batch 1, 1.15x at 32
    (bench/results/hot_path.md, fifth pass). Without either (AVX2: bf16 emulated), fp32."""
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


def _check_engine_config(engine_config: EngineConfig, model_config: ModelConfig) -> None:
    limit = model_config.max_position_embeddings
    if engine_config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {engine_config.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )


def _check_lm_head_quantization(model_config: ModelConfig, config: QuantizationConfig) -> None:
    if not config.quantize_lm_head:
        return
    if not config.enabled:
        raise ValueError("quantize_lm_head needs quantization 'int8' or 'int4', not 'none'")
    if model_config.tie_word_embeddings:
        raise ValueError(
            "quantize_lm_head needs an untied LM head; this model ties it to the embeddings, which stay in float"
        )


def check_tensor_parallel(model_config: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError when the model cannot be split over `tensor_parallel_size` ranks (see models/parallel.py)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    for rank in range(tensor_parallel_size):
        split_heads(model_config.num_heads, model_config.num_kv_heads, tensor_parallel_size, rank)


def kv_sliding_window(model_config: ModelConfig) -> int | None:
    """The window the KV manager may free blocks behind: the widest layer's, when every layer has one."""
    windows = model_config.layer_sliding_windows
    return None if any(window is None for window in windows) else max(windows)


def default_max_model_len(model_config: ModelConfig) -> int:
    # Sliding-window layers attend within their window at any length: the model's positions are the limit.
    return min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def _resolve_attention_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" else "torch"


@dataclass(frozen=True)
class LoadConfig:
    """How the model is loaded and run: precision, device, memory and parallelism (the scheduling limits are
    EngineConfig's)."""

    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16" (see resolve_dtype)
    device: str = "cpu"
    kv_cache_memory_bytes: int | None = None  # per rank; None: 1 GiB on CPU, 85% of what weights leave on CUDA
    kv_offload_bytes: int = 0  # per rank: the host-memory KV tier behind the device cache; 0 turns it off
    seed: int = 0
    attention_backend: str = "auto"  # the Triton kernels on CUDA, the torch backend (the reference) on CPU
    quantization: str = "none"  # "none" | "int8" | "int4" weight-only (hpi_runtime.quantization.quantize)
    quantization_group_size: int = DEFAULT_INT4_GROUP_SIZE
    # Also quantize an untied LM head: off by default, its error lands directly on the logits (a tied head is
    # the embedding, which stays in float).
    quantize_lm_head: bool = False
    int4_fit: str = "mse"  # "mse" | "minmax": how int4 scales/zeros are chosen (quantization/int4_fit.py)
    int4_policy: str = DEFAULT_INT4_POLICY  # which linears int4 keeps at int8 (quantization/policy.py)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # vLLM's name: run the model step without torch.compile


@dataclass(frozen=True)
class PreparedEngine:
    """Everything decided before a weight is read: configs checked, tokenizer loaded, the executor's config.
    The server hands `executor_config` to its engine-core process, which loads the weights itself."""

    engine_config: EngineConfig
    executor_config: ExecutorConfig
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    model_name: str
    model_dir: Path
    eos_token_ids: frozenset[int]
    quantization: str
    vocab_size: int  # rows of the model's embedding
    sampling_defaults: Mapping[str, Any]
    quantization_scheme: str = "none"  # hpi:quantization_info's label, e.g. "int4-g32-mse-mixed", "awq-int4-g128"
    quantization_detail: str = "none"  # the start-up log's line (which linears a mixed policy keeps at int8)

    @property
    def dtype(self) -> str:
        return str(self.executor_config.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(self.executor_config.device)


def prepare_engine(
    model: str | Path | None = None, engine_config: EngineConfig | None = None, load: LoadConfig | None = None
) -> PreparedEngine:
    """Resolve and check everything `create_engine` needs, short of loading the weights (ValueError for bad
    settings, before any weight is read)."""
    from transformers import AutoTokenizer

    load = load or LoadConfig()
    dtype, device, quantization = load.dtype, load.device, load.quantization
    tensor_parallel_size = load.tensor_parallel_size
    model_dir, model_name = resolve_model_dir(model)
    model_config = load_model_config(model_dir)
    quantization_config = QuantizationConfig(quantization, load.quantization_group_size, load.quantize_lm_head,
                                             load.int4_fit, load.int4_policy)  # fmt: skip
    _check_lm_head_quantization(model_config, quantization_config)
    check_tensor_parallel(model_config, tensor_parallel_size)
    resolved = resolve_quantization(model_dir, model_config, quantization_config, tensor_parallel_size)
    engine_config = engine_config or EngineConfig(max_model_len=default_max_model_len(model_config))
    engine_config = replace(engine_config, kv_sliding_window=kv_sliding_window(model_config))
    _check_engine_config(engine_config, model_config)
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but no CUDA device is available")
    torch_dtype = resolve_dtype(dtype, torch_device, model_config.torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos_token_ids = model_config.eos_token_ids | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    )
    if not eos_token_ids:
        raise ValueError(f"{model_dir} defines no EOS token (config, generation_config or tokenizer)")
    executor_config = ExecutorConfig(
        model_config=model_config.for_max_model_len(engine_config.max_model_len),  # LongRoPE picks its factors
        dtype=torch_dtype,
        device=torch_device,
        block_size=engine_config.block_size,
        max_model_len=engine_config.max_model_len,
        kv_tokens_per_request=kv_tokens_per_request(
            engine_config.max_model_len,
            engine_config.block_size,
            engine_config.kv_sliding_window,
            engine_config.max_num_batched_tokens,
        ),
        kv_cache_memory_bytes=load.kv_cache_memory_bytes,
        kv_offload_bytes=load.kv_offload_bytes,
        attention_backend=_resolve_attention_backend(load.attention_backend, torch_device),
        seed=load.seed,
        eos_token_ids=frozenset(eos_token_ids),
        quantization=resolved.config,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=load.enforce_eager,
    )
    return PreparedEngine(
        engine_config=engine_config,
        executor_config=executor_config,
        tokenizer=tokenizer,
        model_name=model_name,
        model_dir=model_dir,
        eos_token_ids=frozenset(eos_token_ids),
        quantization=resolved.method,
        vocab_size=model_config.vocab_size,
        sampling_defaults=dict(model_config.sampling_defaults),
        quantization_scheme=resolved.scheme,
        quantization_detail=resolved.detail,
    )


def create_engine(
    model: str | Path | None = None, engine_config: EngineConfig | None = None, load: LoadConfig | None = None
) -> EngineBundle:
    """Load `model` and build an `LLMEngine` (its core in this process) over a `LocalExecutor`
    (tensor_parallel_size 1) or a `MultiprocExecutor` (one worker process per rank; gloo on CPU, NCCL on
    CUDA devices 0..N-1).

    `engine_config=None` uses EngineConfig's defaults with max_model_len = `default_max_model_len`;
    `load=None` uses LoadConfig's defaults.
    """
    prepared = prepare_engine(model, engine_config, load)
    executor = make_executor(prepared.executor_config)
    engine = LLMEngine(prepared.engine_config, executor, prepared.tokenizer, prepared.eos_token_ids,
                       vocab_size=prepared.vocab_size)
    return EngineBundle(
        engine=engine,
        tokenizer=prepared.tokenizer,
        model_name=prepared.model_name,
        model_dir=prepared.model_dir,
        max_model_len=prepared.engine_config.max_model_len,
        eos_token_ids=prepared.eos_token_ids,
        dtype=prepared.dtype,
        device=prepared.device,
        weight_bytes=executor.weight_bytes,
        kv_cache_bytes=executor.kv_cache_bytes,
        num_kv_blocks=executor.num_kv_blocks,
        quantization=prepared.quantization,
        quantization_scheme=prepared.quantization_scheme,
        vocab_size=prepared.vocab_size,
        sampling_defaults=prepared.sampling_defaults,
    )


class LLM:
    """Offline batch generation over the same engine the server runs.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...          SamplingParams(temperature=0))[0].text
    'The capital of France is Paris.'
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        kv_cache_memory_bytes: int | None = None,
        kv_offload_bytes: int = 0,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        attention_backend: str = "auto",
        quantization: str = "none",
        quantization_group_size: int = DEFAULT_INT4_GROUP_SIZE,
        quantize_lm_head: bool = False,
        int4_fit: str = "mse",
        int4_policy: str = DEFAULT_INT4_POLICY,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
    ) -> None:
        if max_model_len is None:
            model_dir, _ = resolve_model_dir(model)
            max_model_len = default_max_model_len(load_model_config(model_dir))
            model = model_dir if model is not None else None
        engine_config = EngineConfig(
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )
        load = LoadConfig(
            dtype=dtype,
            device=device,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_offload_bytes=kv_offload_bytes,
            seed=seed,
            attention_backend=attention_backend,
            quantization=quantization,
            quantization_group_size=quantization_group_size,
            quantize_lm_head=quantize_lm_head,
            int4_fit=int4_fit,
            int4_policy=int4_policy,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
        )
        self.bundle = create_engine(model, engine_config, load)
        self.engine = self.bundle.engine
        self.tokenizer = self.bundle.tokenizer
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Release the KV cache and stop tensor-parallel worker processes (also done by `with LLM(...)`)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (temperature, top_p, ...)."""
        model_config = load_model_config(self.bundle.model_dir)
        return SamplingParams(**model_config.sampling_defaults)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) and return the final outputs in prompt order.
        `priority`: one per prompt, lower is admitted first (as vLLM's); None: all 0, first come first served."""
        if isinstance(prompts, str):
            prompts = [prompts]
        # With special tokens, as the server and vLLM's LLM.generate do: Llama 2/3 prompts need their BOS.
        token_ids = [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_ids, sampling_params, priority)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_ids = [
            list(
                self.tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            )
            for c in conversations
        ]
        return self._run(token_ids, sampling_params, priority)

    def _run(
        self,
        token_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(token_ids)
        params = list(sampling_params)
        if len(params) != len(token_ids):
            raise ValueError(f"{len(params)} sampling params for {len(token_ids)} prompts")
        priorities = [0] * len(token_ids) if priority is None else list(priority)
        if len(priorities) != len(token_ids):
            raise ValueError(f"{len(priorities)} priorities for {len(token_ids)} prompts")
        request_ids = [f"llm-{next(self._request_counter)}" for _ in token_ids]
        for request_id, ids, p in zip(request_ids, token_ids, params, strict=True):
            self.engine.make_request(request_id, ids, p)  # validate everything before running anything
        pending = list(zip(request_ids, token_ids, params, strict=True))[::-1]
        priority_of = dict(zip(request_ids, priorities, strict=True))
        finished: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {r: [] for r in request_ids}
        while pending or self.engine.has_unfinished_requests():
            while pending:
                try:
                    # DELTA: only the final output carries the whole text, and only it is kept.
                    self.engine.add_request(
                        *pending[-1], priority=priority_of[pending[-1][0]], output_kind=RequestOutputKind.DELTA
                    )
                except QueueFullError:
                    break
                pending.pop()
            for output in self.engine.step():
                logprobs[output.request_id].extend(output.new_logprobs)
                if output.finished:
                    # The caller sees one output per request, so its delta is everything.
                    finished[output.request_id] = dataclasses.replace(
                        output,
                        new_token_ids=output.output_token_ids,
                        text_delta=output.text,
                        new_logprobs=tuple(logprobs[output.request_id]),
                    )
        return [finished[r] for r in request_ids]
