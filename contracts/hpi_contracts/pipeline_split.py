"""Which consecutive decoder layers each pipeline stage holds: the runtime loads and runs that split, the operator
sizes each stage's memory from it (the operator has no torch, so both import this).

The split balances estimated work, not layer counts. The last stage also runs the final norm, the LM head and the
sampler: on a small-vocabulary-per-layer model that is a lot (SmolLM2-135M's 49,152 x 576 head is about 8 of its
3.5M-parameter layers), so an even split in layers leaves every earlier stage waiting for the last one. The head's
cost is counted in layer-equivalents (its parameters over one layer's active parameters: both are matmuls over the
same tokens, about 2 FLOPs per parameter; the sampler's work scales with the head's output, so it rides along),
and the last stage gets that many fewer layers. The embedding lookup on the first stage is a gather, not a matmul:
no cost. `VLLM_PP_LAYER_PARTITION` (vLLM's variable: comma-separated layer counts, first stage first) overrides it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

PP_LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def lm_head_layer_cost(vocab_size: int, hidden_size: int, num_layer_parameters: int) -> float:
    """The LM head's work in decoder layers: its vocab x hidden parameters over one layer's active parameters (the
    attention projections plus the MLP experts a token runs through); 0 when a size is unknown."""
    if num_layer_parameters <= 0 or vocab_size <= 0 or hidden_size <= 0:
        return 0.0
    return vocab_size * hidden_size / num_layer_parameters


def balanced_partition(num_layers: int, num_stages: int, last_stage_cost: float = 0.0) -> tuple[int, ...]:
    """Layer counts per stage, first stage first, that minimise the busiest stage's work when the last stage also
    does `last_stage_cost` layers' worth (the LM head): the last stage takes n layers, the others share the rest as
    evenly as it goes (the larger shares first).

    The head counts in whole layers (to the nearest): layers move between stages whole, and a layer moved off the
    last stage costs an earlier one its memory, so a fraction of a layer's time does not buy one (Llama 3.1 70B's
    head, 1.2 layers, leaves its 80 layers 40 + 40 rather than 41 + 39). Of the n that tie, the one with the
    fewest layers on the fullest stage (its memory), then the least spread in work, then in layers, then the
    smallest n (the last stage's norm and sampler are not counted)."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers: every stage "
                         "needs at least one")  # fmt: skip
    if num_stages == 1:
        return (num_layers,)
    head = math.floor(last_stage_cost + 0.5)

    def split(last: int) -> tuple[int, ...]:
        base, extra = divmod(num_layers - last, num_stages - 1)
        return tuple(base + (1 if stage < extra else 0) for stage in range(num_stages - 1)) + (last,)

    def rank(counts: tuple[int, ...]) -> tuple[int, int, int, int]:
        costs = (*counts[:-1], counts[-1] + head)
        return max(costs), max(counts), max(costs) - min(costs), max(counts) - min(counts)

    return min((split(last) for last in range(1, num_layers - num_stages + 2)), key=rank)


def parse_partition(text: str, num_layers: int, num_stages: int) -> tuple[int, ...]:
    """`VLLM_PP_LAYER_PARTITION`'s value as layer counts; ValueError unless it is one positive count per stage that
    add up to the model's layers."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"${PP_LAYER_PARTITION_ENV} must be comma-separated layer counts, got {text!r}") from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"${PP_LAYER_PARTITION_ENV}={text!r} must give each of the {num_stages} pipeline stages at "
                         f"least one layer, {num_layers} in all")  # fmt: skip
    return counts


def layer_partition(
    num_layers: int, num_stages: int, last_stage_cost: float = 0.0, environ: Mapping[str, str] | None = None
) -> tuple[int, ...]:
    """The split in use: `VLLM_PP_LAYER_PARTITION` from `environ` when set (and more than one stage), else the
    balanced one."""
    override = (environ or {}).get(PP_LAYER_PARTITION_ENV, "").strip()
    if override and num_stages > 1:
        return parse_partition(override, num_layers, num_stages)
    return balanced_partition(num_layers, num_stages, last_stage_cost)


def split_disagreement(stage_spans: list[tuple[int, int]], num_layers: int) -> str | None:
    """Why the stages' (start, stop) layer ranges, first stage first, are not one split of `num_layers` layers (hosts
    that computed different splits, e.g. a $VLLM_PP_LAYER_PARTITION set on some hosts only); None when they are."""
    expected_start = 0
    for stage, (start, stop) in enumerate(stage_spans):
        if start != expected_start:
            return (f"the hosts disagree on the pipeline split: stage {stage} holds layers {start}-{stop - 1}, but the "
                    f"stage before it ends at layer {expected_start - 1}; set the same ${PP_LAYER_PARTITION_ENV} (or "
                    "none) on every host")  # fmt: skip
        expected_start = stop
    if expected_start != num_layers:
        return (f"the hosts disagree on the pipeline split: the last stage ends at layer {expected_start - 1} of "
                f"{num_layers}; set the same ${PP_LAYER_PARTITION_ENV} (or none) on every host")  # fmt: skip
    return None


def format_partition(counts: tuple[int, ...]) -> str:
    """The value of `VLLM_PP_LAYER_PARTITION` that selects `counts`."""
    return ",".join(str(count) for count in counts)
