"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE: Qwen's decoders with sparse MoE blocks (models/moe.py).

Qwen2-MoE: Qwen2's attention (q/k/v bias), softmax-then-top-k routing renormalised only with
`norm_topk_prob`, and a shared expert every token also goes through, scaled by sigmoid(shared_expert_gate).
Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no bias), the same routing, no shared expert. Both keep
the dense MLP in the layers `mlp_only_layers` and `decoder_sparse_step` leave out (ModelConfig.moe).
Checkpoint names: mlp.gate (router), mlp.experts.<e>.{gate,up,down}_proj, mlp.shared_expert.*,
mlp.shared_expert_gate.
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.moe import MoEDecoderMixin
from hpi_runtime.models.qwen3 import Qwen3ForCausalLM


class Qwen2MoeForCausalLM(MoEDecoderMixin, DecoderForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoEDecoderMixin, Qwen3ForCausalLM):
    pass
