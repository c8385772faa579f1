"""The other vision-language families through the real engine against transformers: LLaVA (a Llama decoder, a
CLIP tower, a projector; one position per token) and Qwen2.5-VL (Qwen2-VL's decoder and M-RoPE, a windowed
vision tower). Logits at every step for prompts with 0, 1 and 2 images in one batch, under a chunk budget that
splits prompts (and image placeholder runs) across steps. (Greedy tokens against `generate`: test_mm_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from hpi_testing.multimodal import ATOL, GREEDY
from hpi_testing.multimodal import chat_prompt as _prompt
from hpi_testing.multimodal import make_engine as _engine
from hpi_testing.multimodal import record_logits as _record_logits
from hpi_testing.multimodal import run_to_end as _run
from hpi_testing.tiny_vlm import build_tiny_llava, build_tiny_qwen2_vl, random_image

FAMILIES = {
    "llava": (build_tiny_llava, "LlavaForConditionalGeneration", [[], [16], [16, 16]]),
    "qwen2_5_vl": (lambda d: build_tiny_qwen2_vl(d, qwen2_5=True), "Qwen2_5_VLForConditionalGeneration",
                   [[], [4], [4, 12]]),  # fmt: skip
}


def _hf_inputs(family: str, token_ids: list[int], mm_inputs, image_token_id: int) -> dict:
    ids = torch.tensor([token_ids])
    if family == "llava":
        inputs = {"input_ids": ids}
        if mm_inputs:
            inputs["pixel_values"] = torch.stack([torch.from_numpy(mm.pixel_values) for mm in mm_inputs])
        return inputs
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_token_id).int()}
    if mm_inputs:
        inputs["pixel_values"] = torch.cat([torch.from_numpy(mm.pixel_values) for mm in mm_inputs])
        inputs["image_grid_thw"] = torch.tensor([mm.grid_thw for mm in mm_inputs])
    return inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_with_0_1_2_images(family: str, tmp_path) -> None:
    import transformers

    build, hf_class, image_rows = FAMILIES[family]
    model_dir = build(tmp_path / family)
    hf = getattr(transformers, hf_class).from_pretrained(model_dir, dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()  # fmt: skip
    image_token_id = hf.config.image_token_id
    engine = _engine(model_dir, max_num_batched_tokens=24, encoder_cache_size=64, max_num_encoder_input_tokens=64)
    records = _record_logits(engine)
    requests = {
        "text": _prompt(engine, model_dir, "Hello world, how are you?", []),
        "one": _prompt(engine, model_dir, "What is this?", [random_image(56, 56, seed=1)]),
        "two": _prompt(engine, model_dir, "Compare them.", [random_image(56, 56, seed=2),
                                                            random_image(112, 84, seed=3)]),  # fmt: skip
    }
    assert [[mm.length for mm in mm_inputs] for _, mm_inputs in requests.values()] == image_rows
    finals = _run(engine, requests)
    mm_of = {request_id: mm for request_id, (_, mm) in requests.items()}
    assert len(records) == 3 * GREEDY.max_tokens
    for request_id, token_ids, logits in records:
        with torch.no_grad():
            expected = hf(**_hf_inputs(family, token_ids, mm_of[request_id], image_token_id)).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4, msg=lambda m, r=request_id: f"{r}: {m}")
    for request_id in requests:  # greedy: each token is the argmax of logits that matched transformers'
        argmaxes = [int(logits.argmax()) for r, _, logits in records if r == request_id]
        assert list(finals[request_id].output_token_ids) == argmaxes
