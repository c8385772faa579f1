"""How a model family reads its config.json where it differs from Llama.

Each family module (llama.py, qwen2.py, qwen3.py, phi3.py, gemma.py, mixtral.py, qwen_moe.py) states its
rules as a subclass of `FamilyRules` and hangs an instance on its model class (`config_rules`);
`load_model_config` asks the architecture's rules (through the registry) instead of testing architecture
names. The base class is Llama's reading, which Mistral shares. Rules hold no state: only methods and
constants.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.models.config import MoEConfig, VisionConfig

LayerTypes = list[str]  # per layer: "sliding_attention" or "full_attention" (transformers' `layer_types`)


class FamilyRules:
    """Llama's reading of config.json; a family overrides the hooks where it reads differently."""

    __slots__ = ()  # no state: one instance per family is shared by every config it reads

    default_rope_theta = 10000.0  # RoPE base frequency when config.json names none
    ties_word_embeddings = False  # transformers' default of `tie_word_embeddings`

    def sliding_window(self, raw: dict[str, Any]) -> Any:
        """The configured window (None or 0: none)."""
        return raw.get("sliding_window")

    def layer_types(self, raw: dict[str, Any], num_layers: int) -> LayerTypes | None:
        """Which layers use the window when config.json has no `layer_types`; None: every layer."""
        return None

    def rope_type(self, rope_type: str) -> str:
        """The RoPE type this runtime implements for the name config.json gives."""
        return rope_type

    def sliding_rope_params(self) -> dict[str, Any] | None:
        """The sliding-window layers' own RoPE when config.json names none; None: the global RoPE."""
        return None

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        """ModelConfig fields that differ from the common reading (biases from `attention_bias`, activation)."""
        return {}

    def moe(self, raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
        """The Mixture-of-Experts feed-forward; None: every layer has the dense MLP."""
        return None

    def vision(self, raw: dict[str, Any]) -> VisionConfig | None:
        """A vision-language model's image side; None: a text-only model."""
        return None


def expert_counts(raw: dict[str, Any]) -> tuple[int, int]:
    """(number of experts, top-k) of a MoE config.json, validated."""
    # Mixtral and transformers 5 write num_local_experts, Qwen's Hub configs num_experts.
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok", 2))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    return num_experts, top_k
