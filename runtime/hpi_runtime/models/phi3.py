"""Phi-3 / Phi-3.5 / Phi-4-mini: the shared decoder with a checkpoint that stores qkv_proj and gate_up_proj
already fused. LongRoPE scaling and partial rotation are RoPE configuration (rotary.py).

The fused tensors are loaded through the same tensor-parallel loaders as separate ones: the checkpoint's
qkv_proj is cut into its q, k and v rows and gate_up_proj into its halves, each then sliced for this rank.
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import FamilyRules
from hpi_runtime.models.linear import FUSED_GATE_UP, FUSED_QKV


class Phi3Rules(FamilyRules):
    __slots__ = ()

    def rope_type(self, rope_type: str) -> str:
        # transformers' Phi3Config maps "yarn" onto LongRoPE too.
        return "longrope" if rope_type == "yarn" else rope_type


class Phi3ForCausalLM(DecoderForCausalLM):
    config_rules = Phi3Rules()
    packed_modules_mapping = {
        "qkv_proj": ("qkv_proj", FUSED_QKV),
        "gate_up_proj": ("gate_up_proj", FUSED_GATE_UP),
    }
