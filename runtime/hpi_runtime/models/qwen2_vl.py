"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder (this runtime's, with the paged KV cache) fed by a vision tower,
with M-RoPE.

The vision tower is transformers' own `Qwen2VisionTransformerPretrainedModel` (patch embedding, ViT blocks with
2D rotary, the 2x2 patch merger; Qwen2.5-VL's `Qwen2_5_VisionTransformerPretrainedModel` adds window attention
and gated MLPs, the decoder side is the same), built from the checkpoint's `vision_config` and filled with its
`visual.*` weights: the faithful encoder, kept in the activation dtype and never quantized (quantization walks this
runtime's linear layers only). An image's embedding rows replace its placeholder tokens' embeddings.

M-RoPE: a text token's position is the same on the three axes; an image's placeholders take (temporal, row,
column) positions from where the image starts, and the text after it resumes past the image's largest extent
(transformers' `get_rope_index`). Every position of a request is known once its prompt is: `mrope_positions`
computes them, and a generated token's position is its index plus the prompt's `delta`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.models.config import ModelConfig, VisionConfig
from hpi_runtime.models.parallel import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from hpi_runtime.models.qwen2 import Qwen2ForCausalLM, Qwen2Rules
from hpi_runtime.multimodal.inputs import MultiModalInput


class Qwen2VLRules(Qwen2Rules):
    __slots__ = ()

    def rope_type(self, rope_type: str) -> str:
        return "default" if rope_type == "mrope" else rope_type  # older configs name M-RoPE as a type

    def vision(self, raw: dict[str, Any]) -> VisionConfig | None:
        vision = dict(raw.get("vision_config") or {})
        if "image_token_id" not in raw:
            raise ValueError("a Qwen2-VL config.json needs image_token_id")
        return VisionConfig(
            image_token_id=int(raw["image_token_id"]),
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            vision_config=vision,
        )


def mrope_positions(
    num_tokens: int, mm_inputs: Sequence[MultiModalInput], spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """([3, num_tokens] int64 positions of a prompt, delta): a later token i sits at i + delta on every axis."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    index, next_position = 0, 0  # next_position: where the next text token sits
    for mm in mm_inputs:
        text = mm.offset - index
        positions[:, index : mm.offset] = next_position + np.arange(text)
        start = next_position + text
        grid_t, grid_h, grid_w = (
            mm.grid_thw[0],
            mm.grid_thw[1] // spatial_merge_size,
            mm.grid_thw[2] // spatial_merge_size,
        )
        t, h, w = np.meshgrid(np.arange(grid_t), np.arange(grid_h), np.arange(grid_w), indexing="ij")
        positions[:, mm.offset : mm.end] = np.stack([t.ravel(), h.ravel(), w.ravel()]) + start
        index, next_position = mm.end, start + max(grid_h, grid_w)
    positions[:, index:] = next_position + np.arange(num_tokens - index)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    config_rules: ClassVar[Qwen2VLRules] = Qwen2VLRules()
    unpacked_prefixes: ClassVar[tuple[str, ...]] = ("visual.",)  # the tower keeps the checkpoint's own names
    # (module under transformers.models, vision config class, vision tower class)
    vision_classes: ClassVar[tuple[str, str, str]] = (
        "qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel")

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel = SINGLE,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:  # fmt: skip
        import importlib

        if tp.size > 1:
            raise ValueError(f"{config.architecture} runs with tensor_parallel_size 1 (the vision tower is not split)")
        if stage.size > 1:  # engine_factory.check_pipeline_parallel refuses it first
            raise ValueError(f"{config.architecture} runs with pipeline_parallel_size 1 (the tower is not split)")
        super().__init__(config, backend, tp, stage)
        family, config_class, tower_class = self.vision_classes
        configuration = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        vision_config = getattr(configuration, config_class)(**config.vision.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.visual = getattr(modeling, tower_class)._from_config(vision_config)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """transformers 5's in-memory names (model.language_model.*, model.visual.*) as the saved ones."""
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        return name

    def embed_images(self, images: Sequence[MultiModalInput]) -> list[torch.Tensor]:
        """Images -> each one's embedding rows [placeholders, hidden_size], in one pass of the tower (its
        attention keeps each image to itself)."""
        parameter = next(self.visual.parameters())
        pixels = torch.cat([torch.from_numpy(mm.pixel_values) for mm in images]).to(parameter.device, parameter.dtype)
        grid = torch.tensor([mm.grid_thw for mm in images], dtype=torch.int64, device=parameter.device)
        rows = self.visual(pixels, grid_thw=grid).pooler_output
        return list(rows.split([mm.length for mm in images]))

    def mrope_positions(self, num_tokens: int, mm_inputs: Sequence[MultiModalInput]) -> tuple[np.ndarray, int]:
        return mrope_positions(num_tokens, mm_inputs, self.config.vision.spatial_merge_size)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_classes = ("qwen2_5_vl", "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel")
