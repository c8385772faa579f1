"""Tensor parallelism: which slice of each weight a rank holds, and the collectives between ranks.

Megatron-style: attention heads, MLP columns and the vocabulary are split across ranks; the layers whose
input is split (o_proj, down_proj, the embedding lookup) produce partial sums that are all-reduced, and
the LM head's vocabulary slices are gathered on rank 0, which samples.

Splits are balanced and need not be even. Attention is split along KV groups (a KV head with the query
heads that read it), so GQA stays uniform inside every rank:
- tp_size <= num_kv_heads: each rank gets a contiguous run of whole groups (SmolLM2-135M's 9 query / 3 KV
  heads at tp 2: rank 0 holds groups 0-1 (6 heads), rank 1 group 2 (3 heads));
- tp_size > num_kv_heads: tp_size must be a multiple of num_kv_heads and the group's query heads must
  split evenly over the ranks sharing it; each such rank keeps a replica of its group's KV head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpi_contracts.pipeline_split import layer_partition, lm_head_layer_cost

if TYPE_CHECKING:
    from hpi_runtime.models.config import ModelConfig

MLP_SPLIT_UNIT = 32  # intermediate columns move between ranks in 32s, so int4 groups of 32 never straddle


@dataclass(frozen=True)
class Span:
    """A contiguous slice [start, start + size) of some dimension."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def balanced_span(total: int, parts: int, index: int, unit: int = 1) -> Span:
    """Part `index` of `total` split into `parts` contiguous spans in multiples of `unit` (the last unit may
    be short); sizes differ by at most one unit and the larger spans come first."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    num_units = -(-total // unit)
    if num_units < parts:
        raise ValueError(f"{total} cannot be split into {parts} non-empty parts of {unit}")
    base, extra = divmod(num_units, parts)
    start_unit = index * base + min(index, extra)
    stop_unit = start_unit + base + (1 if index < extra else 0)
    start, stop = start_unit * unit, min(stop_unit * unit, total)
    return Span(start, stop - start)


def mlp_span(intermediate_size: int, tp_size: int, tp_rank: int) -> Span:
    """The rank's MLP columns (of gate, of up, and rows of down's input): in units of MLP_SPLIT_UNIT when the
    size allows."""
    unit = MLP_SPLIT_UNIT if intermediate_size % MLP_SPLIT_UNIT == 0 else 1
    return balanced_span(intermediate_size, tp_size, tp_rank, unit)


@dataclass(frozen=True)
class HeadSplit:
    """The query heads and KV heads one rank holds (global head indices)."""

    q: Span
    kv: Span


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """The rank's heads; ValueError naming what would work when tp_size cannot split them."""
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv = balanced_span(num_kv_heads, tp_size, tp_rank)
        return HeadSplit(Span(kv.start * group, kv.size * group), kv)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        works = [n for n in range(1, 2 * num_heads + 1)
                 if n <= num_kv_heads or (n % num_kv_heads == 0 and group % (n // num_kv_heads) == 0)]  # fmt: skip
        raise ValueError(
            f"tensor_parallel_size {tp_size} cannot split {num_heads} attention heads over {num_kv_heads} KV "
            f"heads: a size above the KV head count must be a multiple of it whose share divides the "
            f"{group} query heads per KV head; sizes that work for this model: {works}"
        )
    per_rank = group // replicas
    kv_head = tp_rank // replicas
    return HeadSplit(Span(kv_head * group + (tp_rank % replicas) * per_rank, per_rank), Span(kv_head, 1))


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group. The default is the single-process case, where
    every collective is the identity and nothing touches torch.distributed."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default (world) group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` any rank passed (host integers, e.g. KV blocks that fit every rank)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_columns(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """[rows, sizes[rank]] on every rank -> [rows, sum(sizes)] on rank 0 (None elsewhere).

        Uneven slices travel padded to the largest, since the collectives want equal shapes."""
        if self.size == 1:
            return x
        width = max(sizes)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.is_first else None
        torch.distributed.gather(padded, parts, dst=self._global_rank(0), group=self.group)
        if not self.is_first:
            return None
        return torch.cat([part[:, :n] for part, n in zip(parts, sizes, strict=True)], dim=1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=self._global_rank(0), group=self.group)
        return x

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return torch.distributed.get_global_rank(self.group, group_rank)

    def _device(self) -> torch.device:
        if torch.distributed.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


SINGLE = TensorParallel()


@dataclass(frozen=True)
class PipelineStage:
    """This process's place in the pipeline: which consecutive layers it holds, and the link to the stages
    around it. The first stage embeds the tokens, the last one norms, computes logits and samples; hidden
    states travel from each tensor-parallel rank of a stage to the same rank of the next (they are replicated
    within a stage after the all-reduce). The default is the whole model in one stage: no link at all."""

    rank: int = 0
    size: int = 1
    layers: Span = Span(0, 0)  # Span(0, 0) on the default stage: every layer (see owns_layer)
    link: Any = None  # worker/pp_link.py's StageLink between this stage and its neighbours; None with one stage

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns_layer(self, layer: int) -> bool:
        return self.size == 1 or self.layers.start <= layer < self.layers.stop

    def min_int(self, value: int) -> int:
        """The smallest `value` any rank of any stage passed (KV blocks that fit every stage's layers)."""
        return value if self.link is None else self.link.min_int(value)


SINGLE_STAGE = PipelineStage()


def pipeline_partition(model_config: ModelConfig, pp_size: int, environ: Mapping[str, str]) -> tuple[int, ...]:
    """Layers per pipeline stage, first stage first: balanced by cost, the last stage's LM head counted in layers
    (hpi_contracts.pipeline_split, which the operator sizes each stage's memory with), unless
    $VLLM_PP_LAYER_PARTITION in `environ` says otherwise. Every host of a group computes the same split."""
    head_cost = lm_head_layer_cost(model_config.vocab_size, model_config.hidden_size, model_config.num_layer_parameters)
    return layer_partition(model_config.num_layers, pp_size, head_cost, environ)


def stage_layers(partition: tuple[int, ...], stage: int) -> Span:
    """The consecutive layers of pipeline stage `stage` under `partition` (layer counts per stage)."""
    if not 0 <= stage < len(partition):
        raise ValueError(f"pipeline stage {stage} of {len(partition)} does not exist")
    return Span(sum(partition[:stage]), partition[stage])
