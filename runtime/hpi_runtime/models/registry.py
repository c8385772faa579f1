"""The architecture registry: config.json's `architectures` entry -> the model class that implements it.

Keep in step with config.SUPPORTED_ARCHITECTURES (a test checks they name the same architectures).
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.gemma import GemmaForCausalLM
from hpi_runtime.models.llama import LlamaForCausalLM
from hpi_runtime.models.mixtral import MixtralForCausalLM
from hpi_runtime.models.phi3 import Phi3ForCausalLM
from hpi_runtime.models.qwen3 import Qwen3ForCausalLM
from hpi_runtime.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
