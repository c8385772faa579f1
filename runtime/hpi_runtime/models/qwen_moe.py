"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE: Qwen's decoders with sparse MoE blocks (models/moe.py).

Qwen2-MoE: Qwen2's attention (q/k/v bias), softmax-then-top-k routing renormalised only with
`norm_topk_prob`, and a shared expert every token also goes through, scaled by sigmoid(shared_expert_gate).
Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no bias), the same routing, no shared expert. Both keep
the dense MLP in the layers `mlp_only_layers` and `decoder_sparse_step` leave out (ModelConfig.moe).
Checkpoint names: mlp.gate (router), mlp.experts.<e>.{gate,up,down}_proj, mlp.shared_expert.*,
mlp.shared_expert_gate.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.models.config import MoEConfig
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import LayerTypes, expert_counts
from hpi_runtime.models.moe import MoEDecoderMixin
from hpi_runtime.models.qwen2 import QwenRules
from hpi_runtime.models.qwen3 import Qwen3ForCausalLM


class QwenMoeRules(QwenRules):
    """Qwen's `use_sliding_window`, but the window (when on) covers every layer: no `max_window_layers` rule."""

    __slots__ = ()
    has_shared_expert = False

    def layer_types(self, raw: dict[str, Any], num_layers: int) -> LayerTypes | None:
        return None

    def moe(self, raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
        num_experts, top_k = expert_counts(raw)
        # Layer i is sparse unless listed in mlp_only_layers or (i + 1) is off the decoder_sparse_step grid.
        step = int(raw.get("decoder_sparse_step") or 1)
        mlp_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if self.has_shared_expert else 0
        return MoEConfig(
            num_experts,
            top_k,
            int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared,
            dense_layer_ids=frozenset(i for i in range(num_layers) if i in mlp_only or (i + 1) % step),
        )


class Qwen2MoeRules(QwenMoeRules):
    __slots__ = ()
    has_shared_expert = True

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        # Qwen2's q/k/v bias (never o_proj); transformers 5 writes the flag out.
        return {"qkv_bias": bool(raw.get("qkv_bias", True)), "o_proj_bias": False}


class Qwen3MoeRules(QwenMoeRules):
    __slots__ = ()

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        return {"qk_norm": True}


class Qwen2MoeForCausalLM(MoEDecoderMixin, DecoderForCausalLM):
    config_rules = Qwen2MoeRules()


class Qwen3MoeForCausalLM(MoEDecoderMixin, Qwen3ForCausalLM):
    config_rules = Qwen3MoeRules()
