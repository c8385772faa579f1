"""Linear layers for tensor parallelism: each holds a slice of the full weight and loads it itself.

Every parameter carries a `weight_loader` that takes the unsharded checkpoint tensor and copies this
rank's slice, so any tp size loads from the same safetensors files. Column-parallel layers hold a span of
the output features, row-parallel ones a span of the input features (their partial outputs are summed
across ranks by the model, after the layer, so quantized replacements need not know about it). Merged
layers (qkv, gate_up) hold several checkpoint tensors in one matrix, each loaded through a shard id;
checkpoints that store them already fused (Phi-3) load through the FUSED_* shard ids, which cut the
tensor into its parts first. With tp 1 every span is the whole dimension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpi_runtime.models.parallel import HeadSplit, Span

FUSED_QKV = "qkv"  # shard id of a checkpoint tensor holding all q, then k, then v rows
FUSED_GATE_UP = "fused"  # shard id of a checkpoint tensor holding all gate, then up rows


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _copy_slice(target: torch.Tensor, loaded: torch.Tensor, dim: int, span: Span, what: str) -> None:
    if loaded.shape[dim] < span.stop:
        raise ValueError(f"{what}: checkpoint dimension {dim} is {loaded.shape[dim]}, this rank needs "
                         f"[{span.start}, {span.stop})")  # fmt: skip
    source = loaded.narrow(dim, span.start, span.size)
    if target.shape != source.shape:
        raise ValueError(f"{what}: shape mismatch: parameter {tuple(target.shape)}, checkpoint slice "
                         f"{tuple(source.shape)}")  # fmt: skip
    target.copy_(source)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # Set by cpu_layout.pack_cpu_weights, after loading: `weight` is then hpi_kernels' packed column panels.
        self.packed_out_features: int | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` (a decoder layer's residual stream) when given: the packed CPU op adds it in
        its GEMM (models/decoder.py says why)."""
        if self.packed_out_features is not None:  # the C++ op, called directly (opaque to torch.compile)
            return torch.ops.hpi_kernels.packed_linear(x, self.weight, self.packed_out_features, self.bias, residual)
        out = F.linear(x, self.weight, self.bias)
        return out if residual is None else residual + out


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Rows `out_span` of the full [out, in] weight (and of the bias)."""

    def __init__(self, in_features: int, out_span: Span, bias: bool = False) -> None:
        self.out_span = out_span
        super().__init__(in_features, out_span.size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_slice(param.data, loaded, 0, self.out_span, type(self).__name__)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs stacked in one matrix (gate_proj + up_proj); shard id = index."""

    def __init__(self, in_features: int, out_spans: Sequence[Span], bias: bool = False) -> None:
        self.out_spans = tuple(out_spans)
        super().__init__(in_features, sum(s.size for s in self.out_spans), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str) -> None:
        if shard_id == FUSED_GATE_UP:  # equal parts, one per shard
            for i, part in enumerate(loaded.chunk(len(self.out_spans), dim=0)):
                self.weight_loader(param, part, i)
            return
        offset = sum(s.size for s in self.out_spans[:shard_id])
        span = self.out_spans[shard_id]
        _copy_slice(param.data.narrow(0, offset, span.size), loaded, 0, span, f"shard {shard_id}")


class QKVParallelLinear(LinearBase):
    """q, k and v projections of this rank's heads in one matrix; shard id "q" | "k" | "v"."""

    def __init__(
        self, hidden_size: int, head_dim: int, heads: HeadSplit, bias: bool, total_q_heads: int | None = None
    ) -> None:
        self.head_dim, self.heads = head_dim, heads
        self.num_heads, self.num_kv_heads = heads.q.size, heads.kv.size  # on this rank
        self.total_q_heads = total_q_heads  # of the whole model: needed to cut a FUSED_QKV tensor
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == FUSED_QKV:
            if self.total_q_heads is None:
                raise ValueError("a fused qkv checkpoint tensor needs the layer's total_q_heads")
            q_rows = self.total_q_heads * d
            kv_rows = (loaded.shape[0] - q_rows) // 2
            for part, part_id in zip(loaded.split([q_rows, kv_rows, kv_rows]), "qkv", strict=True):
                self.weight_loader(param, part, part_id)
            return
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        offset, size, heads = {
            "q": (0, q_size, self.heads.q),
            "k": (q_size, kv_size, self.heads.kv),
            "v": (q_size + kv_size, kv_size, self.heads.kv),
        }[shard_id]
        rows = Span(heads.start * d, heads.size * d)
        _copy_slice(param.data.narrow(0, offset, size), loaded, 0, rows, f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """Columns `in_span` of the full weight: a partial product the model sums over ranks. The bias must be
    added once, so only the rank with `holds_bias` loads it; the others keep zeros."""

    def __init__(self, in_span: Span, out_features: int, bias: bool = False, holds_bias: bool = True) -> None:
        self.in_span, self.holds_bias = in_span, holds_bias
        super().__init__(in_span.size, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:
            if self.holds_bias:
                default_weight_loader(param, loaded)
            else:
                param.data.zero_()
            return
        _copy_slice(param.data, loaded, 1, self.in_span, type(self).__name__)

