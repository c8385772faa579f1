"""Mixtral: Mistral's decoder with a sparse Mixture-of-Experts block in every layer (models/moe.py).

Routing: top-k of the router's softmax, renormalised over the k (ModelConfig.moe.norm_topk_prob is always
set). Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and
w2 (down), as both the Hub's files and transformers' save_pretrained write them.
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.moe import MoEDecoderMixin


class MixtralForCausalLM(MoEDecoderMixin, DecoderForCausalLM):
    expert_checkpoint_names = ("w1", "w3", "w2")
    expert_checkpoint_prefix = "block_sparse_moe."
