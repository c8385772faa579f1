"""Turn a rendered prompt and its images into what the engine takes: the model's own image processor from
transformers (resizing, normalising, patching), each image's placeholder token expanded to one token per
embedding row, and a `MultiModalInput` per image with its content hash.

The PIL processors are used (`Qwen2VLImageProcessorPil`, LLaVA's `CLIPImageProcessorPil`): `AutoProcessor`
needs torchvision for the video processor, which does not import beside the CPU torch build. The settings come
from the checkpoint's preprocessor_config.json (min/max pixels, sizes, mean, std), so prompts match what
transformers' processor builds.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from hpi_runtime.models.config import VisionConfig
from hpi_runtime.multimodal.inputs import MultiModalInput

# architecture -> (module, class) of its PIL image processor
IMAGE_PROCESSORS = {
    "Qwen2VLForConditionalGeneration": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        "Qwen2VLImageProcessorPil",
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        "Qwen2VLImageProcessorPil",
    ),
    "LlavaForConditionalGeneration": ("transformers.models.clip.image_processing_pil_clip", "CLIPImageProcessorPil"),
}
_PROCESSOR_KEYS = ("min_pixels", "max_pixels", "size", "patch_size", "temporal_patch_size", "merge_size",
                   "image_mean", "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize",
                   "do_convert_rgb", "crop_size", "do_center_crop", "resample")  # fmt: skip


class ImageProcessor:
    def __init__(self, model_dir: Path, architecture: str, vision: VisionConfig) -> None:
        if architecture not in IMAGE_PROCESSORS:
            raise ValueError(f"no image processor for {architecture}")
        module, name = IMAGE_PROCESSORS[architecture]
        self.patches_in_grid = vision.temporal_patch_size > 1  # Qwen2-VL's flat patches with a grid, else [3, H, W]
        settings = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
                    "merge_size": vision.spatial_merge_size} if self.patches_in_grid else {}  # fmt: skip
        path = Path(model_dir) / "preprocessor_config.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            settings.update({k: v for k, v in saved.items() if k in _PROCESSOR_KEYS})
        self.processor = getattr(importlib.import_module(module), name)(**settings)
        self.vision = vision
        # Part of every image hash: the same image processed otherwise makes other embeddings.
        self._settings_key = json.dumps(settings, sort_keys=True).encode()

    def image_hash(self, image: Image.Image) -> str:
        digest = hashlib.sha256(self._settings_key)
        digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
        digest.update(image.tobytes())
        return digest.hexdigest()

    def process(
        self, prompt_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """The prompt with each image's one placeholder token expanded to its embedding rows, and the images.
        ValueError when the prompt's placeholders and the images do not pair up."""
        image_token = self.vision.image_token_id
        slots = [i for i, token in enumerate(prompt_ids) if token == image_token]
        if len(slots) != len(images):
            raise ValueError(f"the rendered prompt has {len(slots)} image placeholders for {len(images)} images")
        merge = self.vision.spatial_merge_size**2
        expanded: list[int] = []
        mm_inputs = []
        previous = 0
        for slot, image in zip(slots, images, strict=True):
            out = self.processor(images=[image], return_tensors="np")
            pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
            if self.patches_in_grid:
                grid = tuple(int(n) for n in np.asarray(out["image_grid_thw"])[0])
            else:  # one frame [1, 3, H, W]: a row per patch (the vision tower's CLS row is dropped)
                pixel_values = pixel_values[0]
                patch = self.vision.patch_size
                grid = (1, pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch)
            num_rows = grid[0] * grid[1] * grid[2] // merge
            expanded.extend(prompt_ids[previous:slot])
            mm_inputs.append(MultiModalInput(
                mm_hash=self.image_hash(image), offset=len(expanded), length=num_rows,
                pixel_values=pixel_values, grid_thw=grid,
            ))  # fmt: skip
            expanded.extend([image_token] * num_rows)
            previous = slot + 1
        expanded.extend(prompt_ids[previous:])
        return expanded, tuple(mm_inputs)
