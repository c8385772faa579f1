"""Memory arithmetic for one replica: weights, KV cache and overhead, per dtype and quantization.

Numbers follow the runtime: weight-only int8 (per output channel) and int4 (group size 128, one bf16 scale
per group) for every linear layer; embeddings stay in the activation dtype; the KV cache is stored in the
activation dtype. The overhead term covers the CUDA context, activations and allocator slack; it is
deliberately generous so that a profile the operator picks does not OOM at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import ModelSize, ModelSpec, SpecError

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
INT4_GROUP_SIZE = 128
# Bytes per quantized weight, scales included (int8 scales are per output channel: negligible).
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5 + 2 / INT4_GROUP_SIZE}
CUDA_CONTEXT_BYTES = 1 * GIB  # per GPU
CPU_RUNTIME_BYTES = GIB // 2  # interpreter, tokenizer, HTTP server
OVERHEAD_FRACTION_OF_WEIGHTS = 0.10  # activations and allocator fragmentation grow with the model


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs to know about a model."""

    num_parameters: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 0
    vocab_size: int = 0

    @property
    def num_embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size


EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Well-known models, so common CRs need no size hints (keys: lower-case Hugging Face name, no org).
KNOWN_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m-instruct": ModelShape(134_515_008, 30, 3, 64, 576, 49152),
    "smollm2-135m": ModelShape(134_515_008, 30, 3, 64, 576, 49152),
    "smollm2-360m-instruct": ModelShape(361_821_120, 32, 5, 64, 960, 49152),
    "smollm2-1.7b-instruct": ModelShape(1_711_376_384, 24, 32, 64, 2048, 49152),
    "llama-3.1-8b-instruct": ModelShape(8_030_261_248, 32, 8, 128, 4096, 128256),
    "llama-3.1-8b": ModelShape(8_030_261_248, 32, 8, 128, 4096, 128256),
    "meta-llama-3-8b-instruct": ModelShape(8_030_261_248, 32, 8, 128, 4096, 128256),
    "llama-3.1-70b-instruct": ModelShape(70_553_706_496, 80, 8, 128, 8192, 128256),
    "llama-3.3-70b-instruct": ModelShape(70_553_706_496, 80, 8, 128, 8192, 128256),
    "mistral-7b-instruct-v0.3": ModelShape(7_248_023_552, 32, 8, 128, 4096, 32768),
    "qwen2.5-7b-instruct": ModelShape(7_615_616_512, 28, 4, 128, 3584, 152064),
}


def model_shape(model: ModelSpec) -> ModelShape:
    """The model's shape from its size hints, else from the table of known models; SpecError if unknown."""
    if model.source == "embedded":
        known = KNOWN_SHAPES["smollm2-135m-instruct"]
    elif model.source == "huggingface" and model.hf_id:
        known = KNOWN_SHAPES.get(model.hf_id.rsplit("/", 1)[-1].lower())
    else:
        known = None
    hints: ModelSize = model.size
    values = {
        "num_parameters": hints.num_parameters,
        "num_layers": hints.num_layers,
        "num_kv_heads": hints.num_kv_heads,
        "head_dim": hints.head_dim,
        "hidden_size": hints.hidden_size,
        "vocab_size": hints.vocab_size,
    }
    if known is not None:
        values = {k: v if v is not None else getattr(known, k) for k, v in values.items()}
    missing = [k for k in ("num_parameters", "num_layers", "num_kv_heads", "head_dim") if not values[k]]
    if missing:
        hint_names = {
            "num_parameters": "parameters",
            "num_layers": "numLayers",
            "num_kv_heads": "numKVHeads",
            "head_dim": "headDim",
        }
        fields = ", ".join(f"spec.model.size.{hint_names[k]}" for k in missing)
        raise SpecError(f"cannot size the model for placement: set {fields}")
    return ModelShape(**{k: int(v or 0) for k, v in values.items()})


def weight_bytes(shape: ModelShape, dtype: str, quantization: str) -> int:
    dense = DTYPE_BYTES[dtype]
    if quantization == "none":
        return shape.num_parameters * dense
    embeddings = min(shape.num_embedding_parameters, shape.num_parameters)
    linear = shape.num_parameters - embeddings
    return math.ceil(linear * QUANTIZED_WEIGHT_BYTES[quantization]) + embeddings * dense


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]  # K and V


def kv_cache_bytes(shape: ModelShape, dtype: str, num_tokens: int, block_size: int) -> int:
    """Bytes for `num_tokens` tokens of KV cache, rounded up to whole blocks."""
    return math.ceil(num_tokens / block_size) * block_size * kv_bytes_per_token(shape, dtype)


def overhead_bytes(weights: int, num_gpus: int) -> int:
    fixed = CUDA_CONTEXT_BYTES * num_gpus if num_gpus else CPU_RUNTIME_BYTES
    return fixed + math.ceil(weights * OVERHEAD_FRACTION_OF_WEIGHTS)


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"
