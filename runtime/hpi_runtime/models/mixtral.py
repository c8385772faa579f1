"""Mixtral: Mistral's decoder with a sparse Mixture-of-Experts block in every layer (models/moe.py).

Routing: top-k of the router's softmax, renormalised over the k (ModelConfig.moe.norm_topk_prob is always
set). Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and
w2 (down), as both the Hub's files and transformers' save_pretrained write them.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.models.config import MoEConfig
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import FamilyRules, expert_counts
from hpi_runtime.models.moe import MoEDecoderMixin


class MixtralRules(FamilyRules):
    """Mistral's reading plus a sparse MoE block in every layer, each expert of `intermediate_size`."""

    __slots__ = ()

    def moe(self, raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
        num_experts, top_k = expert_counts(raw)
        return MoEConfig(num_experts, top_k, int(raw["intermediate_size"]), norm_topk_prob=True)


class MixtralForCausalLM(MoEDecoderMixin, DecoderForCausalLM):
    config_rules = MixtralRules()
    expert_checkpoint_names = ("w1", "w3", "w2")
    expert_checkpoint_prefix = "block_sparse_moe."
