"""Mixture-of-Experts feed-forward: a router picks top-k experts per token, each expert is a SiLU-gated MLP.

`SparseMoeBlock` is what a decoder layer uses in place of the dense MLP when `ModelConfig.moe` says the
layer is sparse (Mixtral, Qwen2-MoE, Qwen3-MoE; `MoEConfig` holds the family's choices). Its parts:
- the router (`gate`): replicated on every rank and never quantized (a few outputs that decide which
  experts run); softmax over all experts in fp32, top-k, renormalised over the k when the family does;
- the experts, stacked: w13 [E, 2 * I, H] (each expert's gate rows then up rows) and w2 [E, H, I]. Tensor
  parallelism splits every expert's intermediate dimension I (column-parallel w13, row-parallel w2), so
  each rank runs every expert on its slice and the block all-reduces once;
- Qwen2-MoE's shared expert, a dense MLP every token goes through, scaled by a sigmoid gate.

The experts run as one opaque op, `hpi::moe_experts`, so torch.compile graphs span whole layers (the
routed token counts are data-dependent). Inside: on CUDA with float weights, hpi_kernels' fused-MoE Triton
kernel (grouped GEMMs over expert-sorted token blocks); otherwise grouped matmuls: the (token, slot) pairs
sorted by expert, one matmul per active expert over its tokens, results scaled by the routing weights and
summed back per token. Weight-only int8/int4 experts (`QuantizedExperts`) go through the same grouped loop with
the quantized matmul op of the device (torch's packed ops on CPU, hpi_kernels' Triton matmuls on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hpi_runtime.models.config import ModelConfig, MoEConfig
from hpi_runtime.models.linear import MergedColumnParallelLinear, RowParallelLinear, default_weight_loader
from hpi_runtime.models.parallel import Span, TensorParallel, mlp_span
from hpi_runtime.quantization.linear import QuantizedWeight, op_dtype, pack_int4_for_cpu

# our parameter name parts of the stacked expert weights (packed_modules_mapping targets); their shard ids
# are (expert, 0 = gate | 1 = up) and the expert
W13, W2 = "mlp.experts.w13", "mlp.experts.w2"


def expert_params_mapping(
    num_experts: int, names: tuple[str, str, str], prefix: str = "mlp."
) -> dict[str, tuple[str, object]]:
    """Loader entries (see DecoderForCausalLM.packed_modules_mapping) for per-expert checkpoint tensors
    `<prefix>experts.<e>.<gate|up|down>`: Mixtral's block_sparse_moe. + (w1, w3, w2), Qwen-MoE's mlp. +
    (gate_proj, up_proj, down_proj). They must come before the dense MLP's own entries, which would match
    `experts.<e>.gate_proj` too."""
    gate, up, down = names
    mapping: dict[str, tuple[str, object]] = {}
    for e in range(num_experts):
        mapping[f"{prefix}experts.{e}.{gate}"] = (W13, (e, 0))
        mapping[f"{prefix}experts.{e}.{up}"] = (W13, (e, 1))
        mapping[f"{prefix}experts.{e}.{down}"] = (W2, e)
    if prefix != "mlp.":
        mapping[f"{prefix}gate"] = ("mlp.gate", None)  # the router
    return mapping


class MoEDecoderMixin:
    """For a DecoderForCausalLM family: SparseMoeBlock in the sparse layers (the family's dense MLP in the
    others) and the loader entries of the per-expert checkpoint names the class declares."""

    expert_checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    expert_checkpoint_prefix = "mlp."

    def __init__(self, config: ModelConfig, *args: object, **kwargs: object) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture}: a Mixture-of-Experts family needs ModelConfig.moe")
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]
        names, prefix = self.expert_checkpoint_names, self.expert_checkpoint_prefix
        self.packed_modules_mapping = {
            **expert_params_mapping(config.moe.num_experts, names, prefix),
            **type(self).packed_modules_mapping,  # type: ignore[attr-defined]
        }

    def make_mlp(self, config: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        if is_sparse_layer(config.moe, layer):
            return SparseMoeBlock(config, tp)
        return super().make_mlp(config, layer, tp)  # type: ignore[misc]


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int64)
    """Softmax over all experts in fp32, the k largest; renormalised to sum to 1 over those k when asked
    (Mixtral always: the same as a softmax over the k chosen logits)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class ReplicatedGate(nn.Module):
    """A small replicated linear without bias that quantization leaves in float: it is no LinearBase, which
    is what quantize_model swaps. The MoE router and Qwen2-MoE's shared-expert gate."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _load_expert_slice(target: torch.Tensor, loaded: torch.Tensor, dim: int, span: Span, what: str) -> None:
    if loaded.dim() != 2 or loaded.shape[dim] < span.stop:
        raise ValueError(f"{what}: checkpoint tensor {tuple(loaded.shape)} lacks [{span.start}, {span.stop}) "
                         f"along dimension {dim}")  # fmt: skip
    default_weight_loader(target, loaded.narrow(dim, span.start, span.size))


class ExpertsGateUp(nn.Module):
    """Every expert's gate and up projections, this rank's rows `span` of each: weight [E, 2 * span, H]."""

    def __init__(self, num_experts: int, hidden_size: int, span: Span) -> None:
        super().__init__()
        self.span = span
        self.weight = nn.Parameter(torch.empty(num_experts, 2 * span.size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id  # part 0: gate (w1), 1: up (w3)
        target = param.data[expert].narrow(0, part * self.span.size, self.span.size)
        _load_expert_slice(target, loaded, 0, self.span, f"expert {expert} {('gate', 'up')[part]}")


class ExpertsDown(nn.Module):
    """Every expert's down projection, this rank's input columns `span` of each: weight [E, H, span]."""

    def __init__(self, num_experts: int, hidden_size: int, span: Span) -> None:
        super().__init__()
        self.span = span
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, span.size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert: int) -> None:
        _load_expert_slice(param.data[expert], loaded, 1, self.span, f"expert {expert} down")


class FusedExperts(nn.Module):
    """All experts of one layer in float: w13.weight [E, 2 * I_rank, H], w2.weight [E, H, I_rank]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        span = mlp_span(intermediate_size, tp.size, tp.rank)
        self.w13 = ExpertsGateUp(num_experts, hidden_size, span)
        self.w2 = ExpertsDown(num_experts, hidden_size, span)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.hpi.moe_experts(x, topk_weights, topk_ids, [self.w13.weight], [self.w2.weight], "none", 0)

    def quantize(self, quantize_fn: Callable[[torch.Tensor], QuantizedWeight]) -> QuantizedExperts:
        """The int8/int4 replacement; `quantize_fn` is the offline step for one [N, K] weight."""
        w13 = [quantize_fn(w) for w in self.w13.weight.detach()]
        w2 = [quantize_fn(w) for w in self.w2.weight.detach()]
        weight = self.w13.weight
        return QuantizedExperts(w13, w2, weight.dtype, weight.device)


class QuantizedExperts(nn.Module):
    """All experts of one layer with int8/int4 weights, stacked in the layout the device's matmul op reads
    (the same layouts as QuantizedLinear, one more leading expert dimension)."""

    def __init__(
        self,
        w13: list[QuantizedWeight],  # per expert, [2 * I_rank, H]
        w2: list[QuantizedWeight],  # per expert, [H, I_rank]
        dtype: torch.dtype,  # activation dtype
        device: torch.device,
    ) -> None:
        super().__init__()
        self.method, self.group_size = w13[0].method, w13[0].group_size or 0
        self.device_type = torch.device(device).type
        scale_dtype = op_dtype(device, dtype)
        self.w13 = nn.ParameterList(self._stack(w13, scale_dtype, device))
        self.w2 = nn.ParameterList(self._stack(w2, scale_dtype, device))

    def _stack(
        self, weights: list[QuantizedWeight], scale_dtype: torch.dtype, device: torch.device
    ) -> list[nn.Parameter]:
        def frozen(parts: list[torch.Tensor]) -> nn.Parameter:
            return nn.Parameter(torch.stack(parts).to(device).contiguous(), requires_grad=False)

        if self.method == "int8":  # [E, N, K] int8, [E, N]
            return [frozen([w.qweight for w in weights]), frozen([w.scales.to(scale_dtype) for w in weights])]
        if self.device_type == "cpu":  # [E, N_pad, K // 2] in torch's CPU tile layout, [E, K // g, N_pad, 2]
            packed = [pack_int4_for_cpu(w) for w in weights]
            return [frozen([p for p, _ in packed]), frozen([sz.to(scale_dtype) for _, sz in packed])]
        return [  # [E, N, K // 2] uint8 (hpi_kernels.quant layout), [E, N, K // g] scales, zeros
            frozen([w.qweight for w in weights]),
            frozen([w.scales.to(scale_dtype) for w in weights]),
            frozen([w.zeros.to(scale_dtype) for w in weights]),  # type: ignore[union-attr]
        ]

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        return f"experts={self.w13[0].shape[0]}, {self.method}{group}, {self.device_type}"

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.hpi.moe_experts(
            x, topk_weights, topk_ids, list(self.w13), list(self.w2), self.method, self.group_size
        )


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SiLU-gated MLP (tensor-parallel like the dense one) whose partial sum
    the block reduces together with the routed experts'."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        span = mlp_span(intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [span, span])
        self.down_proj = RowParallelLinear(span, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ shared expert): [T, H] -> [T, H], summed over tensor-parallel ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        if config.hidden_act != "silu":  # every MoE family here gates its experts with SiLU
            raise ValueError(f"{config.architecture}: Mixture-of-Experts layers support hidden_act 'silu' only, "
                             f"got {config.hidden_act!r}")  # fmt: skip
        self.tp, self.top_k, self.renormalize = tp, moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = ReplicatedGate(config.hidden_size, moe.num_experts)
        self.experts = FusedExperts(moe.num_experts, config.hidden_size, moe.expert_intermediate_size, tp)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(config.hidden_size, moe.shared_expert_intermediate_size, tp)
            self.shared_expert_gate = ReplicatedGate(config.hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            # The sigmoid gate is replicated, so scaling each rank's partial sum scales the total.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


def is_sparse_layer(moe: MoEConfig | None, layer: int) -> bool:
    """Whether decoder layer `layer` uses a SparseMoeBlock (else the dense MLP)."""
    return moe is not None and layer not in moe.dense_layer_ids


# --- the experts op -------------------------------------------------------------------------------------

torch.library.define(
    "hpi::moe_experts",
    "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor[] w13, Tensor[] w2, str method, "
    "int group_size) -> Tensor",
)


def _expert_matmul(
    x: torch.Tensor,  # [M, K]
    weights: list[torch.Tensor],  # one projection of all experts, as FusedExperts / QuantizedExperts hold it
    expert: int,
    method: str,
    group_size: int,
    out_features: int,
) -> torch.Tensor:  # [M, out_features], x.dtype
    if method == "none":
        return F.linear(x, weights[0][expert])
    compute_dtype = weights[1].dtype  # the scales' dtype: see quant_linear.op_dtype
    rows = x.to(compute_dtype).contiguous()
    if x.device.type == "cpu":
        if method == "int8":
            out = torch.ops.aten._weight_int8pack_mm(rows, weights[0][expert], weights[1][expert])
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weights[0][expert], group_size, weights[1][expert])
            out = out[:, :out_features]
    else:
        from hpi_kernels.quant_matmul import int4_weight_only_matmul, int8_weight_only_matmul

        if method == "int8":
            out = int8_weight_only_matmul(rows, weights[0][expert], weights[1][expert])
        else:
            out = int4_weight_only_matmul(rows, weights[0][expert], weights[1][expert], weights[2][expert], group_size)
    return out.to(x.dtype)


def grouped_experts(
    hidden: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
    num_experts: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, [M, H]) -> [M, H]
) -> torch.Tensor:  # [T, H]
    """The (token, slot) pairs sorted by expert, one call of `expert_mlp` per active expert over its tokens,
    each result scaled by its routing weight into a contiguous run of the sorted output; one gather puts the
    slots back in token order and the k slots of a token are summed. (Scattering with index_add_ instead
    cost 28 ms for a single [1, 1024] row on torch 2.13's CPU kernel here; index_select is microseconds.)"""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # sorted position -> slot (token * top_k + j)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_ids = order // top_k
    weights = topk_weights.flatten()[order].to(hidden.dtype)
    sorted_out = hidden.new_empty(num_tokens * top_k, hidden.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        y = expert_mlp(expert, hidden.index_select(0, token_ids[start:stop]))
        torch.mul(y, weights[start:stop, None], out=sorted_out[start:stop])
        start = stop
    slot_out = sorted_out.index_select(0, order.argsort())  # slot -> its sorted position
    return slot_out.view(num_tokens, top_k, -1).sum(dim=1)


def moe_experts(
    hidden: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, top_k] fp32
    topk_ids: torch.Tensor,  # [T, top_k] int64
    w13: list[torch.Tensor],  # float: [[E, 2I, H]]; int8: [qweight, scales]; int4: packed, scales(+zeros)
    w2: list[torch.Tensor],  # the same for [E, H, I]
    method: str,  # "none" | "int8" | "int4"
    group_size: int,  # int4 only
) -> torch.Tensor:  # [T, H]
    if method == "none" and hidden.device.type == "cuda":
        from hpi_kernels.fused_moe import fused_experts

        return fused_experts(hidden, w13[0], w2[0], topk_weights, topk_ids)
    hidden_size = hidden.shape[1]
    intermediate = w2[0].shape[2] if method == "none" else w2[0].shape[2] * (2 if method == "int4" else 1)

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = _expert_matmul(x, w13, expert, method, group_size, 2 * intermediate).chunk(2, dim=-1)
        return _expert_matmul(F.silu(gate) * up, w2, expert, method, group_size, hidden_size)

    return grouped_experts(hidden, topk_weights, topk_ids, w13[0].shape[0], expert_mlp)


torch.library.impl("hpi::moe_experts", "CompositeExplicitAutograd", moe_experts)


@torch.library.register_fake("hpi::moe_experts")
def _(hidden, topk_weights, topk_ids, w13, w2, method, group_size):
    return hidden.new_empty(hidden.shape)
