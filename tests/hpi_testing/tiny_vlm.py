"""Tiny random-weight vision-language model directories (Qwen2-VL) built with transformers' own classes, and
images for them: the runtime's real loading path and transformers' reference, with no download.

Besides what tiny_model.py writes, the directory has the image markers as special tokens, Qwen2-VL's chat
template (one <|vision_start|><|image_pad|><|vision_end|> per image part) and a preprocessor_config.json with
small pixel bounds, so an image is a handful of embedding rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpi_testing.tiny_model import build_tokenizer

QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image_url' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_MARKERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
PATCH = 14
MERGE = 2
MIN_PIXELS = 56 * 56  # a 56x56 image: 4x4 patches, 4 embedding rows
MAX_PIXELS = 112 * 112  # at most 8x8 patches, 16 rows


def build_tiny_qwen2_vl(
    out_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    vision_depth: int = 2,
    vision_embed_dim: int = 32,
    max_pixels: int = MAX_PIXELS,
    qwen2_5: bool = False,
) -> Path:
    """Write a random-weight Qwen2-VL directory to `out_dir` and return it (fp32). The defaults are the tests'
    tiny model; the benchmark builds a larger one of the same shape. `qwen2_5`: Qwen2.5-VL's tower (window
    attention on all but its last block, gated MLPs) instead."""
    import torch
    import transformers

    tokenizer = build_tokenizer(extra_special_tokens=IMAGE_MARKERS)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    start, pad, end = (tokenizer.convert_tokens_to_ids(t) for t in IMAGE_MARKERS)
    num_heads = max(4, hidden_size // 64)
    head_dim = hidden_size // num_heads
    prefix = "Qwen2_5_VL" if qwen2_5 else "Qwen2VL"
    vision = {"depth": vision_depth, "hidden_size": hidden_size, "num_heads": max(2, vision_embed_dim // 32),
              "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2}  # fmt: skip
    if qwen2_5:  # hidden_size is the tower's width there, out_hidden_size the decoder's
        vision.update(hidden_size=vision_embed_dim, out_hidden_size=hidden_size, intermediate_size=2 * vision_embed_dim,
                      window_size=56, fullatt_block_indexes=[vision_depth - 1])  # fmt: skip
    else:
        vision.update(embed_dim=vision_embed_dim, mlp_ratio=2)
    config = getattr(transformers, f"{prefix}Config")(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]},
        },
        vision_config=vision,
        image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
        video_token_id=tokenizer.unk_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    return _save_random(model, tokenizer, out_dir, {
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": MIN_PIXELS, "max_pixels": max_pixels,
        "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE,
    })  # fmt: skip


def _save_random(model, tokenizer, out_dir: str | Path, preprocessor: dict) -> Path:
    """Re-draw the model's matrices wider than transformers' init (decisive greedy tokens, image rows that
    matter) and save it with its tokenizer and image processor config."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15 if "embed_tokens" in name or "lm_head" in name else 0.08)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return out_dir


def random_image(width: int, height: int, seed: int):
    """A PIL RGB image of noise (every pixel matters to the encoder)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_data_url(image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_IMAGE_SIDE = 56  # CLIP at 56 px, 14 px patches: 16 rows an image


def build_tiny_llava(out_dir: Path, *, seed: int = 0) -> Path:
    """A random-weight LLaVA directory (Llama decoder, CLIP vision tower, projector), fp32."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tokenizer = build_tokenizer(extra_special_tokens=("<image>",))
    tokenizer.chat_template = LLAVA_TEMPLATE
    config = LlavaConfig(
        text_config={
            "model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": LLAVA_IMAGE_SIDE,
                       "patch_size": PATCH, "projection_dim": 32},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    return _save_random(model, tokenizer, out_dir, {
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": LLAVA_IMAGE_SIDE},
        "crop_size": {"height": LLAVA_IMAGE_SIDE, "width": LLAVA_IMAGE_SIDE},
    })  # fmt: skip
