"""LLaVA: a Llama decoder (this runtime's, with the paged KV cache) fed by a CLIP or SigLIP vision tower and a
two-layer projector; positions stay one per token.

The vision tower and the projector are transformers' own (`AutoModel.from_config(vision_config)`,
`LlavaMultiModalProjector`), built from the checkpoint's config.json and filled with its weights, in the activation
dtype and never quantized. An image's rows are the tower's patch features at `vision_feature_layer` (the CLS row
dropped under the "default" strategy), projected to the decoder's width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.models.config import ModelConfig, VisionConfig
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import FamilyRules
from hpi_runtime.models.parallel import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from hpi_runtime.multimodal.inputs import MultiModalInput

# saved name prefix -> ours (transformers 5 saves the first form, older llava-hf checkpoints the second)
_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)


class LlavaRules(FamilyRules):
    __slots__ = ()

    def vision(self, raw: dict[str, Any]) -> VisionConfig | None:
        vision = dict(raw.get("vision_config") or {})
        image_token_id = raw.get("image_token_id", raw.get("image_token_index"))
        if image_token_id is None:
            raise ValueError("a LLaVA config.json needs image_token_id (or image_token_index)")
        if raw.get("vision_feature_select_strategy", "default") != "default":  # the processor counts patch rows
            raise ValueError("LLaVA with vision_feature_select_strategy 'full' (the CLS row kept) is not supported")
        return VisionConfig(image_token_id=int(image_token_id), patch_size=int(vision.get("patch_size", 14)),
                            temporal_patch_size=1, spatial_merge_size=1, vision_config=vision)  # fmt: skip


class LlavaForConditionalGeneration(DecoderForCausalLM):
    config_rules: ClassVar[LlavaRules] = LlavaRules()
    unpacked_prefixes: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel = SINGLE,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:  # fmt: skip
        from transformers import AutoModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        if tp.size > 1:
            raise ValueError("LLaVA runs with tensor_parallel_size 1 (the vision tower is not split)")
        if stage.size > 1:  # engine_factory.check_pipeline_parallel refuses it first
            raise ValueError(f"{config.architecture} runs with pipeline_parallel_size 1 (the tower is not split)")
        super().__init__(config, backend, tp, stage)
        hf_config = LlavaConfig.from_pretrained(config.model_dir)
        hf_config.vision_config._attn_implementation = "sdpa"
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.feature_layer = hf_config.vision_feature_layer
        self.drop_cls = hf_config.vision_feature_select_strategy == "default"

    @staticmethod
    def checkpoint_name(name: str) -> str:
        for saved, ours in _RENAMES:
            if name.startswith(saved):
                name = ours + name.removeprefix(saved)
        return name

    def embed_images(self, images: Sequence[MultiModalInput]) -> list[torch.Tensor]:
        """Images (frames [3, H, W] of one size, as the processor crops them) -> each one's embedding rows
        [patches, hidden_size], in one pass of the tower."""
        parameter = next(self.vision_tower.parameters())
        pixels = torch.stack([torch.from_numpy(mm.pixel_values) for mm in images]).to(parameter.device, parameter.dtype)
        out = self.vision_tower(pixels, output_hidden_states=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        features = [out.hidden_states[i][:, 1:] if self.drop_cls else out.hidden_states[i] for i in layers]
        return list(self.multi_modal_projector(torch.cat(features, dim=-1)).unbind(0))
