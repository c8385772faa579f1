"""Weight-only INT8 / INT4 quantization at load time, split as gpt-fast does.

Offline step (pure, no modules): `quantize_weight` turns one float [N, K] weight into a `QuantizedWeight`
(INT8: symmetric, one scale per output channel; INT4: asymmetric, group-wise along K, two values per byte,
scales and zeros chosen by a data-free MSE search (int4_fit.py) or plain min/max; formats from
hpi_kernels.quant), and `quantized_state_dict` does it for every linear of a model. Which method each
linear gets is the config's mixed-precision policy (quantization/policy.py).
Runtime step: `quantize_model` swaps every linear layer (qkv, o, gate_up, down; not the embeddings and,
unless asked, not the LM head) for a `QuantizedLinear` (MoE experts for `QuantizedExperts`; routers stay
float), one layer at a time, releasing each float weight as soon as its replacement exists. The executor has the
loader call it after each decoder layer is read (`within`), so the float model is never whole in memory: peak
memory is the quantized model plus one float layer. The loaders do the tensor-parallel slicing; each rank quantizes
its own shard, so INT4 groups along K need K_per_rank % group_size == 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hpi_kernels.quant import pack_int4, quantize_int4, quantize_int8
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.models.layers import VocabEmbedding
from hpi_runtime.models.linear import LinearBase
from hpi_runtime.models.moe import FusedExperts
from hpi_runtime.models.parallel import mlp_span, split_heads
from hpi_runtime.quantization.checkpoint import read_checkpoint_quantization
from hpi_runtime.quantization.int4_fit import fit_int4
from hpi_runtime.quantization.linear import QuantizedLinear, QuantizedWeight, a8_rows, op_dtype
from hpi_runtime.quantization.policy import DEFAULT_INT4_POLICY, INT4_POLICIES, describe_policy, layer_method

QUANTIZATION_METHODS = ("none", "int8", "int4")
INT4_FITS = ("mse", "minmax")  # how int4 scales/zeros are chosen: the MSE search (default) or min/max
ACTIVATIONS = ("auto", "int8", "float")  # int4 / int8 on CPU: W4A8 / W8A8 (int8 x per group) or float x; linear.py
INT4_GROUP_SIZES = (32, 64, 128)
# Measured (docs/quantization.md): on the embedded SmolLM2-135M group 32 keeps perplexity within 0.3% of
# the float model where group 64 loses 12% (44% with plain min/max), for 4% fewer weight bytes (that
# checkpoint was converted from a Q4_1 GGUF, itself a group-32 grid, which flatters 32); 128 does not divide
# its K = 576. 32 divides the K of every Llama-family model, so it is the default that always loads.
DEFAULT_INT4_GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantizationConfig:
    method: str = "none"  # "none" | "int8" | "int4"
    group_size: int = DEFAULT_INT4_GROUP_SIZE  # int4 only: weights per (scale, zero) pair along K
    quantize_lm_head: bool = False  # untied heads only; a tied head shares the (float) embedding
    int4_fit: str = "mse"  # "mse" | "minmax": how int4 scales and zeros are chosen (int4_fit.py)
    int4_policy: str = DEFAULT_INT4_POLICY  # which linears int4 keeps at higher precision (quantization/policy.py)
    int4_activations: str = "auto"  # "auto" | "int8" | "float": W4A8 on CPU panels (linear.a8_rows)
    # int4_activations "int8": W4A8 up to this many rows, float x above; -1 at every row count ("auto" resolves to
    # the count measured on the device, linear.a8_rows)
    int4_a8_max_rows: int = -1
    # The same for --quantization int8's linears: W8A8 on CPU panels. int4's int8 layers (its mixed policy's q/k/v)
    # take it only when set to "int8": "auto" keeps their float x, as the policy keeps their weights at int8 (the
    # layers rounding hurts most; with x in int8 the embedded model's thin-margin answers tip, docs/quantization.md)
    int8_activations: str = "auto"
    int8_a8_max_rows: int = -1
    # An int8 LM head (quantize_lm_head) on CPU panels: W8A8 with each row's leading logits recomputed from float x
    # (hpi_kernels.int8_a8_logits), up to this many rows as above
    lm_head_activations: str = "auto"
    lm_head_a8_max_rows: int = -1

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {self.method!r}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}; got {self.group_size!r}")
        if self.int4_fit not in INT4_FITS:
            raise ValueError(f"int4_fit must be one of {', '.join(INT4_FITS)}; got {self.int4_fit!r}")
        if self.int4_policy not in INT4_POLICIES:
            raise ValueError(f"int4_policy must be one of {', '.join(INT4_POLICIES)}; got {self.int4_policy!r}")
        for method in ("int4", "int8", "lm_head"):
            setting, max_rows = getattr(self, f"{method}_activations"), getattr(self, f"{method}_a8_max_rows")
            if setting not in ACTIVATIONS:
                raise ValueError(f"{method}_activations must be one of {', '.join(ACTIVATIONS)}; got {setting!r}")
            if max_rows < -1:
                raise ValueError(f"{method}_a8_max_rows must be -1 (every row count) or >= 0; got {max_rows}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def a8_suffix(self, method: str) -> str:
        """"-a8" (x in int8 at every row count), "-a8upto<n>" or "" for `method`'s linears ("auto" is resolved per
        device first)."""
        if getattr(self, f"{method}_activations") != "int8":
            return ""
        max_rows = getattr(self, f"{method}_a8_max_rows")
        return "-a8" if max_rows == -1 else f"-a8upto{max_rows}"

    @property
    def int8_layers_a8_asked(self) -> bool:
        """int4 whose policy keeps int8 layers, with int8_activations "int8": those layers take W8A8 too."""
        return self.method == "int4" and bool(INT4_POLICIES[self.int4_policy]) and self.int8_activations == "int8"

    @property
    def scheme(self) -> str:
        """The name the `hpi:quantization_info` metric and the start-up log give this quantization, with x in int8
        (W8A8, W4A8) as a suffix."""
        if self.method == "int8":
            return "int8" + self.a8_suffix("int8")
        if self.method != "int4":
            return self.method
        int8_layers = f"-int8{self.a8_suffix('int8')}" if self.int8_layers_a8_asked else ""
        return f"int4-g{self.group_size}-{self.int4_fit}-{self.int4_policy}{self.a8_suffix('int4')}{int8_layers}"


def quantize_weight(
    weight: torch.Tensor,  # [N, K] float
    config: QuantizationConfig,
    scale_dtype: torch.dtype | None = None,  # default: weight.dtype
) -> QuantizedWeight:
    """The offline step for one weight. Integer codes are rounded against the scales as stored in
    `scale_dtype` (the dtype the matmul will read them in), so storing them costs no extra error."""
    if not config.enabled:
        raise ValueError("quantize_weight needs method 'int8' or 'int4', not 'none'")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [N, K] tensor, got {weight.dtype} {tuple(weight.shape)}")
    if config.method == "int8":
        qweight, scales = quantize_int8(weight, scale_dtype)
        return QuantizedWeight("int8", qweight, scales)
    k = weight.shape[1]
    if k % config.group_size != 0:
        raise ValueError(f"int4 group size {config.group_size} does not divide the layer's K = {k}")
    if config.int4_fit == "minmax":
        packed, scales, zeros = quantize_int4(weight, config.group_size, scale_dtype)
        return QuantizedWeight("int4", packed, scales, zeros, config.group_size)
    codes, scales, zeros = fit_int4(weight, config.group_size, scale_dtype or weight.dtype)
    return QuantizedWeight("int4", pack_int4(codes), scales, zeros, config.group_size)


QuantizationTarget = tuple[str, nn.Module, "QuantizationConfig"]  # (module name, float module, its config)


def _quantizable(model: nn.Module, config: QuantizationConfig) -> Iterator[QuantizationTarget]:
    """(name, float module, the config it is quantized with) for every linear the policy quantizes."""
    num_layers = getattr(model.config, "num_layers", 0)
    for name, module in model.named_modules():
        if isinstance(module, (LinearBase, FusedExperts)):  # MoE experts: every expert's w13 and w2; not the router
            method = layer_method(config.method, config.int4_policy, name, num_layers)
            if method != "none":
                yield name, module, dataclasses.replace(config, method=method)
    stage = getattr(model, "stage", None)
    if config.quantize_lm_head and (stage is None or stage.is_last):  # a pipeline stage before the last has none
        lm_head = getattr(model, "lm_head", None)
        if lm_head is None:
            raise ValueError("quantize_lm_head is set but the model has no lm_head")
        if getattr(model.config, "tie_word_embeddings", False):  # the embedding reads its rows from it: int8
            config = dataclasses.replace(config, method="int8")
        yield "lm_head", lm_head, config


def quantized_state_dict(model: nn.Module, config: QuantizationConfig) -> dict[str, torch.Tensor]:
    """gpt-fast's "make the quantized state dict": `<layer>.qweight/.scales[/.zeros]` for every linear."""
    state: dict[str, torch.Tensor] = {}
    for name, module, layer_config in _quantizable(model, config):
        if isinstance(module, FusedExperts):
            for part in ("w13", "w2"):
                for expert, weight in enumerate(getattr(module, part).weight.detach()):
                    qw, prefix = quantize_weight(weight, layer_config), f"{name}.{expert}.{part}"
                    state[f"{prefix}.qweight"], state[f"{prefix}.scales"] = qw.qweight, qw.scales
                    if qw.zeros is not None:
                        state[f"{prefix}.zeros"] = qw.zeros
            continue
        qw = quantize_weight(module.weight.detach(), layer_config)
        state[f"{name}.qweight"], state[f"{name}.scales"] = qw.qweight, qw.scales
        if qw.zeros is not None:
            state[f"{name}.zeros"] = qw.zeros
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach()
    return state


# How many of each row's largest W8A8 logits an int8 LM head recomputes from float x (those within a nat of the
# largest; hpi_kernels.int8_a8_logits): greedy decoding's choice among near-ties is float x's, as it was.
LM_HEAD_RESCORE = 16


class QuantizedLMHead(QuantizedLinear):
    """The LM head's contract: hidden states -> fp32 logits. On CPU panels an int8 head returns its fp32 sums
    unrounded (hpi_kernels.int8_logits), as the float head does (packed_logits); with x in int8 (W8A8,
    `lm_head_activations`) the leading logits of each row are recomputed from float x (int8_a8_logits)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_panels and self.method == "int8":
            rows = x.reshape(-1, self.in_features).to(self.activation_dtype)
            if self.int8_activations:  # W8A8, each row's leaders recomputed from float x
                logits = torch.ops.hpi_kernels.int8_a8_logits(rows, self.qweight, self.scales, self.out_features,
                                                              self.a8_max_rows, LM_HEAD_RESCORE)  # fmt: skip
            else:
                logits = torch.ops.hpi_kernels.int8_logits(rows, self.qweight, self.scales, self.out_features)
            return logits.reshape(*x.shape[:-1], self.out_features)
        return super().forward(x).float()


def _reduction_dims(model_config: ModelConfig, tp_size: int) -> dict[str, int]:
    """Each quantized layer's K (per rank: o_proj and down_proj take a rank's slice of their input)."""
    ks = {"qkv_proj / gate_up_proj (hidden_size)": model_config.hidden_size}
    for rank in range(tp_size):
        heads = split_heads(model_config.num_heads, model_config.num_kv_heads, tp_size, rank)
        mlp = mlp_span(model_config.intermediate_size, tp_size, rank)
        where = f", rank {rank}" if tp_size > 1 else ""
        ks[f"o_proj (heads x head_dim{where})"] = heads.q.size * model_config.head_dim
        ks[f"down_proj (intermediate_size{where})"] = mlp.size
        moe = model_config.moe
        if moe is not None:
            experts = mlp_span(moe.expert_intermediate_size, tp_size, rank)
            ks[f"experts' w2 (moe_intermediate_size{where})"] = experts.size
            if moe.shared_expert_intermediate_size:
                shared = mlp_span(moe.shared_expert_intermediate_size, tp_size, rank)
                ks[f"shared_expert.down_proj (shared_expert_intermediate_size{where})"] = shared.size
    return ks


def check_model_supported(model_config: ModelConfig, config: QuantizationConfig, tp_size: int = 1) -> None:
    """Fail before loading any weight when an int4 group size cannot tile some layer's K on some rank."""
    if config.method != "int4":
        return
    ks = _reduction_dims(model_config, tp_size)
    bad = [f"{layer} K = {k}" for layer, k in ks.items() if k % config.group_size != 0]
    if bad:
        fits = [g for g in INT4_GROUP_SIZES if all(k % g == 0 for k in ks.values())]
        raise ValueError(
            f"int4 group size {config.group_size} does not divide {', '.join(bad)}; "
            f"group sizes that fit this model: {fits or 'none'}"
        )


@dataclass(frozen=True)
class ResolvedQuantization:
    """What the engine runs: the at-load quantization to apply and the names the metric and log show."""

    config: QuantizationConfig  # applied by quantize_model after loading ("none" for pre-quantized weights)
    method: str  # "none" | "int8" | "int4": the weights as the model runs them
    scheme: str  # e.g. "int4-g32-mse-mixed", "gptq-int4-g128-act-order" (the hpi:quantization_info label)
    detail: str  # one line for the start-up log


def resolve_quantization(
    model_dir: Path, model_config: ModelConfig, requested: QuantizationConfig, tp_size: int = 1
) -> ResolvedQuantization:
    """Check the requested quantization against the checkpoint before any weight is read. A pre-quantized
    checkpoint (config.json's quantization_config) runs as it is: asking for its own precision or for none is
    fine, asking to re-quantize it to another is a ValueError, as are unsupported formats."""
    checkpoint = read_checkpoint_quantization(model_dir)
    if checkpoint is None:
        check_model_supported(model_config, requested, tp_size)
        detail = requested.scheme
        if requested.method == "int4":
            detail += f" ({describe_policy(requested.int4_policy, model_config.num_layers)})"
        return ResolvedQuantization(requested, requested.method, requested.scheme, detail)
    if model_config.moe is not None:
        raise ValueError(
            f"pre-quantized ({checkpoint.scheme}) Mixture-of-Experts checkpoints are not supported; load the float "
            "checkpoint with quantization int8 or int4 instead (experts are quantized at load)"
        )
    if requested.method not in ("none", checkpoint.runtime_method):
        raise ValueError(
            f"the checkpoint is pre-quantized ({checkpoint.scheme}); quantization must be 'none' or "
            f"{checkpoint.runtime_method!r}, not {requested.method!r} (it is not re-quantized)"
        )
    if requested.quantize_lm_head:
        raise ValueError(f"quantize_lm_head does not apply to a pre-quantized checkpoint ({checkpoint.scheme})")
    if tp_size > 1:
        raise ValueError(f"pre-quantized ({checkpoint.scheme}) checkpoints load with tensor_parallel_size 1 only")
    return ResolvedQuantization(QuantizationConfig("none"), checkpoint.runtime_method, checkpoint.scheme,
                                f"{checkpoint.scheme} (pre-quantized checkpoint, repacked at load)")  # fmt: skip


def resolve_activations(resolved: ResolvedQuantization, device: torch.device, dtype: torch.dtype,
                        shape: tuple[int, int] | None = None,
                        tied_lm_head: bool = False) -> ResolvedQuantization:  # fmt: skip
    """At-load `int4_activations` (int4) or `int8_activations` (int8) made concrete for the device and activation
    dtype ("auto" -> "int8" up to the row count where W4A8 / W8A8 measure faster on a weight of `shape`, the model's
    gate/up projection, or "float"; linear.a8_rows), so that the scheme label, the log and the compile cache key say
    where the linears take x in int8; the other format's setting becomes "float" (int4's int8 q/k/v keep float x
    unless int8_activations is "int8").
    `lm_head_activations` likewise for an int8 LM head (`quantize_lm_head` with int8, or any head tied to the
    embeddings: `tied_lm_head`), measured on the same shape; "float" without one. ValueError for "int8" on a GPU."""
    config = resolved.config
    if config.method == "none":
        return resolved
    changes, notes = {}, []
    # (setting's prefix, the kernels' format, whether the model has such layers, what the log calls them). The LM
    # head: int8 whenever it is quantized on CPU panels (a tied one always; an untied int4 head keeps float x).
    head_is_int8 = config.quantize_lm_head and (config.method == "int8" or tied_lm_head)
    for name, method, applies, what in (
        ("int4", "int4", config.method == "int4", "the int4 linears (W4A8)"),
        ("int8", "int8", config.method == "int8" or config.int8_layers_a8_asked, "the int8 linears (W8A8)"),
        ("lm_head", "int8", head_is_int8, "the int8 LM head (W8A8), each row's leading logits recomputed from float x"),
    ):
        setting = getattr(config, f"{name}_activations")
        if applies and setting == "int8" and torch.device(device).type != "cpu":
            raise ValueError(f"{name}_activations int8 (W{method[3]}A8) runs on CPU only, not "
                             f"{torch.device(device).type}")  # fmt: skip
        rows = a8_rows(method, setting, device, dtype, shape) if applies else 0
        if applies and setting == "int8":
            rows = getattr(config, f"{name}_a8_max_rows")
        changes[f"{name}_activations"], changes[f"{name}_a8_max_rows"] = ("int8" if rows else "float"), rows or -1
        if rows:
            upto = "" if rows == -1 else f" up to {rows} rows (the float tiles measured faster above)"
            notes.append(f"activations int8 per group of k for {what}{upto}")
    config = dataclasses.replace(config, **changes)
    detail = "; ".join([resolved.detail.replace(resolved.scheme, config.scheme, 1), *notes])
    return dataclasses.replace(resolved, config=config, scheme=config.scheme, detail=detail)


@torch.no_grad()
def quantize_model(model: nn.Module, config: QuantizationConfig, within: str | None = None) -> nn.Module:
    """Swap the model's linear layers for quantized ones in place (returns `model`); "none" is a no-op. With
    `within` (a module name, "model.layers.3"), only the linears under it: the loader quantizes each layer as it
    is loaded (models/loader.py's _load_layer_by_layer), and the rest (the LM head) with `within` None last."""
    if not config.enabled:
        return model
    targets = [t for t in _quantizable(model, config) if within is None or t[0].startswith(within + ".")]
    for name, module, layer_config in targets:
        if isinstance(module, FusedExperts):
            _quantize_experts(model, name, module, layer_config)
            continue
        weight = module.weight
        quantized_cls = QuantizedLMHead if name == "lm_head" else QuantizedLinear
        quantized = quantize_weight(weight.detach(), layer_config, op_dtype(weight.device, weight.dtype))
        # x in int8 by the layer's own format: the quantization's own linears; int4's int8 q/k/v only when
        # int8_activations says int8 (its "auto" does not reach them); an int8 LM head by its own setting.
        method = layer_config.method
        own = method == config.method or config.int8_layers_a8_asked
        activations = getattr(layer_config, f"{method}_activations") if own else "float"
        max_rows = getattr(layer_config, f"{method}_a8_max_rows")
        if name == "lm_head":  # an int4 head keeps float x
            activations = layer_config.lm_head_activations if method == "int8" else "float"
            max_rows = layer_config.lm_head_a8_max_rows
        replacement = quantized_cls(quantized, getattr(module, "bias", None), weight.dtype, weight.device,
                                    activations=activations, a8_max_rows=max_rows)  # fmt: skip
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child_name, replacement)
        if name == "lm_head":  # an embedding tied to it looks its tokens up in the quantized head from now on
            for embedding in _tied_embeddings(model, weight):
                embedding.rows_from = replacement
        # The old parameter's weight_loader (a bound method) ties it to its module in a reference cycle, so
        # it would wait for the garbage collector: drop the storage now to keep peak memory at one layer.
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return model


def _tied_embeddings(model: nn.Module, weight: torch.Tensor) -> list[VocabEmbedding]:
    return [m for m in model.modules() if isinstance(m, VocabEmbedding) and m.weight is weight]


def _quantize_experts(model: nn.Module, name: str, experts: FusedExperts, config: QuantizationConfig) -> None:
    """Swap one layer's float experts for QuantizedExperts (each expert's matrices quantized like a linear)."""
    weights = (experts.w13.weight, experts.w2.weight)
    dtype, device = weights[0].dtype, weights[0].device
    scale_dtype = op_dtype(device, dtype)
    replacement = experts.quantize(lambda w: quantize_weight(w, config, scale_dtype))
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, replacement)
    for weight in weights:  # as for linears: release the float storage now, not at the next GC
        weight.data = torch.empty(0, dtype=dtype, device=device)
