"""The architecture registry, the runtime's one list of architectures: config.json's `architectures` entry ->
the family module and model class that implement it.

Names only, imported on first use (`model_class`): the CLI lists the architectures in `--help` without
importing torch, and a family's module (its model class and its config rules) loads only when a model of
that family does.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpi_runtime.models.decoder import DecoderForCausalLM
    from hpi_runtime.models.family import FamilyRules

# architecture -> (module under hpi_runtime.models, class name)
_MODELS = MappingProxyType(
    {
        "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
        "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
        "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
        "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
        "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
        "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
        "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
        "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
        "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
        "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
        "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
        "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
        "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    }
)
SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The model class of `architecture` (importing its family module); ValueError for one not supported."""
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(f"hpi_runtime.models.{module_name}"), class_name)


def family_rules(architecture: str) -> FamilyRules:
    """How `architecture`'s family reads config.json (its model class's `config_rules`)."""
    return model_class(architecture).config_rules
