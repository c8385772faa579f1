"""Memory arithmetic for one replica: weights, KV cache and overhead, per dtype and quantization.

Numbers follow the runtime: weight-only int8 (per output channel) and int4 (group size 32, a 16-bit scale
and zero per group) for every linear layer; embeddings stay in the activation dtype; the KV cache is stored in the
activation dtype. An fp32 CPU replica of a dense model whose checkpoint is bf16 keeps its linears and LM head in
bf16 panels (`linear_dtype`). The overhead term covers the CUDA context, activations and allocator slack; it is
deliberately generous so that a profile the operator picks does not OOM at start-up.

Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) hold every expert in memory, so `num_parameters`
(what the memory arithmetic uses) counts all of them; each token runs only the router's top-k experts, so
`active_parameters` (the compute per token: about 2 FLOPs per active parameter) is far smaller.

Tensor parallelism follows the runtime's rule (runtime/hpi_runtime/models/parallel.py, `split_heads`; not
imported: the operator installs without torch): attention is split along KV-head groups, so a replica of N
GPUs works when N <= num_kv_heads, or when N is a multiple of num_kv_heads whose share divides the query
heads per KV head. Every rank holds as many KV blocks as the rank with the most KV heads affords, so uneven
splits and replicated KV heads cost KV memory; `kv_bytes_per_token` counts that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hpi_contracts import kv_cache
from hpi_contracts.pipeline_split import balanced_partition, lm_head_layer_cost
from hpi_contracts.serve_flags import SERVE_FLAGS

from .spec import ModelSize, ModelSpec, SpecError, base_model_name

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# The operator never passes --quantization-group-size: the runtime's default is what its pods use.
INT4_GROUP_SIZE = SERVE_FLAGS["--quantization-group-size"].default
# Bytes per quantized weight, scales included (int8 scales are per output channel: negligible).
# int4 keeps a 16-bit scale and a 16-bit zero per group (hpi_kernels.quant's asymmetric format).
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / INT4_GROUP_SIZE}
# A pre-quantized GPTQ/AWQ/compressed-tensors checkpoint keeps its own groups (128 almost always), repacked as is.
CHECKPOINT_INT4_GROUP_SIZE = 128
CHECKPOINT_WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / CHECKPOINT_INT4_GROUP_SIZE}
# The runtime's default --int4-policy (which the operator never overrides), "mixed", keeps every layer's merged
# q/k/v projection at int8 (runtime/hpi_runtime/quantization/policy.py): 10-16% of a dense layer's weights.
INT4_POLICY = SERVE_FLAGS["--int4-policy"].default
INT4_QKV_AT_INT8 = INT4_POLICY == "mixed"
# Without hiddenSize the q/k/v share is unknown: counted as this share of the layers' weights (the known models
# span 0.10 (Llama 3.1 70B) to 0.16 (SmolLM2-135M)).
ASSUMED_QKV_SHARE = 1 / 6
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
    num_heads: int = 0  # query heads; 0 = unknown, so no tensor-parallel split beyond num_kv_heads
    # Mixture-of-Experts: parameters one token runs through (embeddings, attention, router, the top-k and shared
    # experts); 0 = a dense model, where that is every parameter.
    num_active_parameters: int = 0
    # A vision-language model's vision tower and projector, counted in num_parameters: never quantized (the
    # runtime quantizes the language model's linears only); 0 = a text-only model.
    num_vision_parameters: int = 0
    # The dtype the checkpoint stores its weights in ("bf16", "fp16", "fp32"); "" = unknown, counted as the
    # activation dtype (generous: most checkpoints are bf16).
    checkpoint_dtype: str = ""
    # config.json's tie_word_embeddings: the LM head is the embedding, counted once in num_parameters. Otherwise
    # the head is its own vocab_size x hidden_size matrix, which stays in float when the linears are quantized.
    tie_word_embeddings: bool = False

    @property
    def num_embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return 0 < self.num_active_parameters < self.num_parameters


def active_parameters(shape: ModelShape) -> int:
    """Parameters each token is computed with: all of a dense model's, the routed subset of an MoE model's."""
    return shape.num_active_parameters or shape.num_parameters


EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Well-known models, so common CRs need no size hints (keys: lower-case Hugging Face name, no org).
KNOWN_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m-instruct": ModelShape(134_515_008, 30, 3, 64, 576, 49152, num_heads=9, tie_word_embeddings=True),
    "smollm2-135m": ModelShape(134_515_008, 30, 3, 64, 576, 49152, num_heads=9, tie_word_embeddings=True),
    "smollm2-360m-instruct": ModelShape(361_821_120, 32, 5, 64, 960, 49152, num_heads=15, tie_word_embeddings=True),
    "smollm2-1.7b-instruct": ModelShape(1_711_376_384, 24, 32, 64, 2048, 49152, num_heads=32, tie_word_embeddings=True),
    "llama-3.1-8b-instruct": ModelShape(8_030_261_248, 32, 8, 128, 4096, 128256, num_heads=32),
    "llama-3.1-8b": ModelShape(8_030_261_248, 32, 8, 128, 4096, 128256, num_heads=32),
    "meta-llama-3-8b-instruct": ModelShape(8_030_261_248, 32, 8, 128, 4096, 128256, num_heads=32),
    "llama-3.1-70b-instruct": ModelShape(70_553_706_496, 80, 8, 128, 8192, 128256, num_heads=64),
    "llama-3.3-70b-instruct": ModelShape(70_553_706_496, 80, 8, 128, 8192, 128256, num_heads=64),
    "llama-3.1-405b-instruct": ModelShape(405_853_388_800, 126, 8, 128, 16384, 128256, num_heads=128),
    "llama-3.1-405b": ModelShape(405_853_388_800, 126, 8, 128, 16384, 128256, num_heads=128),
    "mistral-7b-instruct-v0.3": ModelShape(7_248_023_552, 32, 8, 128, 4096, 32768, num_heads=32),
    "qwen2.5-7b-instruct": ModelShape(7_615_616_512, 28, 4, 128, 3584, 152064, num_heads=28),
    # Mixture-of-Experts: (all parameters, ..., active parameters), counted from each config.json (untied heads).
    "mixtral-8x7b-v0.1": ModelShape(46_702_792_704, 32, 8, 128, 4096, 32000, 32, 12_879_925_248),
    "mixtral-8x7b-instruct-v0.1": ModelShape(46_702_792_704, 32, 8, 128, 4096, 32000, 32, 12_879_925_248),
    "qwen1.5-moe-a2.7b": ModelShape(14_315_784_192, 24, 16, 128, 2048, 151936, 16, 2_689_173_504),
    "qwen1.5-moe-a2.7b-chat": ModelShape(14_315_784_192, 24, 16, 128, 2048, 151936, 16, 2_689_173_504),
    "qwen2-57b-a14b": ModelShape(57_408_658_944, 28, 4, 128, 3584, 151936, 28, 14_249_270_784),
    "qwen2-57b-a14b-instruct": ModelShape(57_408_658_944, 28, 4, 128, 3584, 151936, 28, 14_249_270_784),
    "qwen3-30b-a3b": ModelShape(30_532_122_624, 48, 4, 128, 2048, 151936, 32, 3_353_032_704),
    "qwen3-30b-a3b-instruct-2507": ModelShape(30_532_122_624, 48, 4, 128, 2048, 151936, 32, 3_353_032_704),
    "qwen3-235b-a22b": ModelShape(235_093_634_560, 94, 4, 128, 4096, 151936, 64, 22_190_763_520),
}


# The Hugging Face checkpoints of every model in KNOWN_SHAPES store bf16 (their config.json's torch_dtype); the
# embedded model is stored in fp32 (make model writes it so, from values that are not all bf16 values).
KNOWN_CHECKPOINT_DTYPE = "bf16"
EMBEDDED_CHECKPOINT_DTYPE = "fp32"


def model_shape(model: ModelSpec) -> ModelShape:
    """The model's shape from its size hints, else from the table of known models; SpecError if unknown."""
    if model.source == "embedded":
        known = replace(KNOWN_SHAPES["smollm2-135m-instruct"], checkpoint_dtype=EMBEDDED_CHECKPOINT_DTYPE)
    elif model.source == "huggingface" and model.hf_id:
        known = KNOWN_SHAPES.get(base_model_name(model.hf_id))
        known = known and replace(known, checkpoint_dtype=KNOWN_CHECKPOINT_DTYPE)
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
        "num_heads": hints.num_heads,
        "num_vision_parameters": hints.num_vision_parameters,
        "checkpoint_dtype": hints.checkpoint_dtype,
        "tie_word_embeddings": hints.tie_word_embeddings,
    }
    if known is not None:
        values = {k: v if v is not None else getattr(known, k) for k, v in values.items()}
        # Known only: a parameters hint for an MoE model counts its experts, which keep the known active share.
        values["num_active_parameters"] = known.num_active_parameters if known.is_moe else 0
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
    checkpoint_dtype, tied = values.pop("checkpoint_dtype") or "", bool(values.pop("tie_word_embeddings"))
    shape = ModelShape(**{k: int(v or 0) for k, v in values.items()}, checkpoint_dtype=checkpoint_dtype,
                       tie_word_embeddings=tied)  # fmt: skip
    if shape.num_heads and shape.num_heads % shape.num_kv_heads:
        # A hint can override one of the two for a known model; spec.py checks the pair only when both are hints.
        raise SpecError(
            f"spec.model.size: {shape.num_kv_heads} KV heads do not divide {shape.num_heads} attention heads "
            "(numKVHeads must divide numHeads)"
        )
    return shape


def splits_heads(shape: ModelShape, num_gpus: int) -> bool:
    """Whether the runtime can split the model's attention over `num_gpus` tensor-parallel ranks."""
    if num_gpus <= max(shape.num_kv_heads, 1):
        return True
    if not shape.num_heads:
        return False  # the runtime's rule above num_kv_heads needs the query heads, which nobody told us
    replicas, remainder = divmod(num_gpus, shape.num_kv_heads)
    return remainder == 0 and (shape.num_heads // shape.num_kv_heads) % replicas == 0


def why_heads_do_not_split(shape: ModelShape, max_gpus: int) -> str:
    """A sentence a user can act on: which GPU counts up to `max_gpus` can split the model's attention."""
    kv_heads = f"{shape.num_kv_heads} KV head{'s' if shape.num_kv_heads > 1 else ''}"
    if not shape.num_heads:
        return f"spec.model.size.numHeads is unknown, so the model is split over at most its {kv_heads}"
    sizes = [str(n) for n in range(1, max_gpus + 1) if splits_heads(shape, n)]
    listed = f"{', '.join(sizes[:-1])} or {sizes[-1]} GPUs" if len(sizes) > 1 else "1 GPU"
    return f"{shape.num_heads} attention heads over {kv_heads} split only over {listed}"


def max_kv_heads_per_rank(shape: ModelShape, num_gpus: int) -> int:
    """KV heads on the fullest rank: balanced whole heads up to num_kv_heads ranks, then one replica each."""
    if num_gpus <= 1:
        return shape.num_kv_heads
    return -(-shape.num_kv_heads // num_gpus) if num_gpus <= shape.num_kv_heads else 1


def linear_dtype(shape: ModelShape, dtype: str, device: str) -> str:
    """The dtype a replica keeps its unquantized linears and LM head in: `dtype`, except an fp32 CPU replica of a
    dense model with a bf16 checkpoint. The runtime packs every fp32 weight whose values are all bf16 values as
    bf16 panels, which its kernels multiply bit for bit as fp32 ones, while it loads (runtime/hpi_runtime/models/
    cpu_layout.py, `_panel_weight`): half the bytes. An untied embedding and a vision tower stay fp32, and so do
    an MoE model's experts (no packed linears; the share they hold is unknown here, so an MoE model is counted
    whole at fp32)."""
    if device == "cpu" and dtype == "fp32" and shape.checkpoint_dtype == "bf16" and not shape.is_moe:
        return "bf16"
    return dtype


@dataclass(frozen=True)
class WeightParts:
    """Bytes of a replica's weights by where a pipeline split puts them."""

    layers: int  # the decoder layers
    embedding: int  # the vocabulary matrix (a tied LM head's too) and a vision tower: the first stage
    head: int  # an untied LM head: the last stage (0 when tied: the last stage holds a copy of the embedding)

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head


def weight_parts(
    shape: ModelShape, dtype: str, quantization: str, prequantized: bool = False, linears: str | None = None
) -> WeightParts:
    """The layers' linears at `quantization` (with the runtime's int4 groups, or the checkpoint's own when
    `prequantized`) or, unquantized, in `linears` (`linear_dtype`; default `dtype`); an untied LM head in `linears`
    too (the runtime quantizes it only with --quantize-lm-head, which the operator never passes); the embedding
    and a vision tower in `dtype`."""
    dense, unquantized = DTYPE_BYTES[dtype], DTYPE_BYTES[linears or dtype]
    kept = min(shape.num_embedding_parameters + shape.num_vision_parameters, shape.num_parameters)
    linear = shape.num_parameters - kept
    head = 0 if shape.tie_word_embeddings else min(shape.num_embedding_parameters, linear)
    layers = linear - head
    if quantization == "none":
        layer_bytes = layers * unquantized
    elif prequantized:  # the checkpoint's own format, every linear alike
        layer_bytes = math.ceil(layers * CHECKPOINT_WEIGHT_BYTES[quantization])
    else:
        at_int8 = int8_under_int4(shape, layers) if quantization == "int4" else 0
        layer_bytes = math.ceil((layers - at_int8) * QUANTIZED_WEIGHT_BYTES[quantization]) + at_int8
    return WeightParts(layer_bytes, kept * dense, head * unquantized)


def int8_under_int4(shape: ModelShape, layer_parameters: int) -> int:
    """Of the layers' `layer_parameters` weights, those the runtime's int4 policy keeps at int8: the q, k and v
    projections of every layer (an assumed share of the layers without hiddenSize)."""
    if not INT4_QKV_AT_INT8:
        return 0
    if not shape.hidden_size:
        return math.ceil(layer_parameters * ASSUMED_QKV_SHARE)
    num_heads = shape.num_heads or shape.hidden_size // max(shape.head_dim, 1)
    qkv = shape.num_layers * shape.hidden_size * shape.head_dim * (num_heads + 2 * shape.num_kv_heads)
    return min(qkv, layer_parameters)


def weight_bytes(
    shape: ModelShape, dtype: str, quantization: str, prequantized: bool = False, linears: str | None = None
) -> int:
    """Bytes of the weights in memory (see weight_parts)."""
    return weight_parts(shape, dtype, quantization, prequantized, linears).total


def stage_partition(shape: ModelShape, num_stages: int = 1) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, first stage first: the runtime's split (hpi_contracts.pipeline_split),
    balanced by cost with the LM head on the last stage counted in layers. One layer's active parameters are what
    is left of the active parameters without the vocabulary matrix and the vision tower (an untied head counts
    as a little layer work: a slightly smaller head cost)."""
    layers_only = active_parameters(shape) - shape.num_embedding_parameters - shape.num_vision_parameters
    layer_parameters = layers_only // max(shape.num_layers, 1)
    head_cost = lm_head_layer_cost(shape.vocab_size, shape.hidden_size, layer_parameters)
    return balanced_partition(shape.num_layers, max(num_stages, 1), head_cost)


def stage_layers(shape: ModelShape, num_stages: int = 1) -> int:
    """Decoder layers of the fullest pipeline stage (its KV cache)."""
    return max(stage_partition(shape, num_stages))


def stage_weight_bytes(
    shape: ModelShape, dtype: str, quantization: str, num_stages: int = 1, prequantized: bool = False,
    linears: str | None = None,
) -> int:
    """Weight bytes of the fullest of `num_stages` pipeline stages (the whole model for one): its decoder layers,
    plus the embedding on the first stage (with the vision tower, if any) and the LM head on the last (a tied head
    is a copy of the embedding there)."""
    parts = weight_parts(shape, dtype, quantization, prequantized, linears)
    if num_stages <= 1:
        return parts.total
    per_layer = parts.layers / shape.num_layers
    head = parts.head or min(shape.num_embedding_parameters, shape.num_parameters) * DTYPE_BYTES[dtype]
    partition = stage_partition(shape, num_stages)
    first, last = partition[0] * per_layer + parts.embedding, partition[-1] * per_layer + head
    return math.ceil(max(first, last, max(partition[1:-1], default=0) * per_layer))


def kv_bytes_per_token(shape: ModelShape, dtype: str, num_gpus: int = 1, num_stages: int = 1,
                       kv_cache_dtype: str = "auto") -> int:  # fmt: skip
    """KV bytes one token costs a replica's fullest pipeline stage (the whole replica with one stage) over the
    stage's GPUs. Every rank allocates the blocks the fullest rank affords, so a stage pays num_gpus x the
    fullest rank's share (the plain K and V size when even). `kv_cache_dtype`: the runtime's --kv-cache-dtype
    (bfloat16: two bytes an element, fp8: one, whatever the model's dtype)."""
    num_ranks = max(num_gpus, 1)
    num_kv_heads = max_kv_heads_per_rank(shape, num_ranks) * num_ranks
    layers = stage_layers(shape, num_stages)
    element_bytes = kv_cache.kv_cache_dtype_bytes(kv_cache_dtype, DTYPE_BYTES[dtype])
    return kv_cache.kv_bytes_per_token(layers, num_kv_heads, shape.head_dim, element_bytes)


def kv_cache_bytes(
    shape: ModelShape, dtype: str, num_tokens: int, block_size: int, num_gpus: int = 1, num_stages: int = 1,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes for `num_tokens` tokens of KV cache over the GPUs of a replica's fullest stage, rounded up to whole
    blocks (every stage holds its own layers' KV of every token)."""
    per_token = kv_bytes_per_token(shape, dtype, num_gpus, num_stages, kv_cache_dtype)
    return math.ceil(num_tokens / block_size) * block_size * per_token


def encoder_cache_bytes(shape: ModelShape, dtype: str, rows: int) -> int:
    """A vision-language model's encoder cache: `rows` image embeddings of hidden_size values (the runtime's
    --encoder-cache-size, by default its --max-num-batched-tokens); nothing for a text-only model."""
    return rows * shape.hidden_size * DTYPE_BYTES[dtype] if shape.num_vision_parameters else 0


def overhead_bytes(weights: int, num_gpus: int, extra: int = 0) -> int:
    """CUDA contexts (or the CPU runtime's process), activations and allocator slack, plus `extra` (an encoder
    cache)."""
    fixed = CUDA_CONTEXT_BYTES * num_gpus if num_gpus else CPU_RUNTIME_BYTES
    return fixed + math.ceil(weights * OVERHEAD_FRACTION_OF_WEIGHTS) + extra


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"
