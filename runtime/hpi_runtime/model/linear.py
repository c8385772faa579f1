"""Linear layers shaped for tensor parallelism: each parameter carries its own `weight_loader`.

Column-parallel layers split the output dimension across ranks, row-parallel ones the input dimension
(and would all-reduce their output). Merged layers (qkv, gate_up) hold several Hugging Face tensors in
one matrix and load each through a shard id. `tp_size` is 1 today; the loaders already slice by rank so
adding ranks only needs a process group and the all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = 0, 1, tp_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps rows [rank * n, (rank + 1) * n)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, tp_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate_proj + up_proj); shard id = index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        source = loaded.narrow(0, self.tp_rank * size, size)
        if target.shape != source.shape:
            raise ValueError(f"shape mismatch for shard {shard_id}: {tuple(target.shape)} vs {tuple(source.shape)}")
        target.copy_(source)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; shard id "q" | "k" | "v". KV heads split like q heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads  # per rank (tp_size 1)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        target = param.data.narrow(0, offset, size)
        source = loaded.narrow(0, self.tp_rank * size, size)
        if target.shape != source.shape:
            raise ValueError(f"shape mismatch for {shard_id}: {tuple(target.shape)} vs {tuple(source.shape)}")
        target.copy_(source)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs would be all-reduced (not needed at tp 1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduce
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))
