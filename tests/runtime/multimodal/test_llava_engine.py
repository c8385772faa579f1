"""LLaVA (a Llama decoder, a CLIP vision tower, a projector; one position per token) through the real engine
against transformers: logits at every step and greedy tokens for prompts with 0, 1 and 2 images in one batch,
with a chunk budget that splits an image's placeholder run."""

from __future__ import annotations

import torch

from hpi_testing.multimodal import ATOL, GREEDY
from hpi_testing.multimodal import chat_prompt as _prompt
from hpi_testing.multimodal import make_engine as _engine
from hpi_testing.multimodal import record_logits as _record_logits
from hpi_testing.multimodal import run_to_end as _run
from hpi_testing.tiny_vlm import random_image


def _hf_inputs(token_ids: list[int], mm_inputs) -> dict:
    inputs = {"input_ids": torch.tensor([token_ids])}
    if mm_inputs:
        inputs["pixel_values"] = torch.stack([torch.from_numpy(mm.pixel_values) for mm in mm_inputs])
    return inputs


def test_llava_matches_transformers_with_0_1_2_images(tiny_llava_dir) -> None:
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()  # fmt: skip
    engine = _engine(tiny_llava_dir, max_num_batched_tokens=24, encoder_cache_size=64, max_num_encoder_input_tokens=64)
    records = _record_logits(engine)
    requests = {
        "text": _prompt(engine, tiny_llava_dir, "Hello world, how are you?", []),
        "one": _prompt(engine, tiny_llava_dir, "What is this?", [random_image(70, 60, seed=1)]),
        "two": _prompt(engine, tiny_llava_dir, "Compare them.", [random_image(56, 56, seed=2),
                                                                 random_image(90, 56, seed=3)]),  # fmt: skip
    }
    assert [[mm.length for mm in mm_inputs] for _, mm_inputs in requests.values()] == [[], [16], [16, 16]]
    finals = _run(engine, requests)
    mm_of = {request_id: mm for request_id, (_, mm) in requests.items()}
    assert len(records) == 3 * GREEDY.max_tokens
    for request_id, token_ids, logits in records:
        with torch.no_grad():
            expected = hf(**_hf_inputs(token_ids, mm_of[request_id])).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4, msg=lambda m, r=request_id: f"{r}: {m}")
    for request_id, (ids, mm_inputs) in requests.items():
        inputs = _hf_inputs(ids, mm_inputs)
        with torch.no_grad():
            out = hf.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]),
                              max_new_tokens=GREEDY.max_tokens, do_sample=False)  # fmt: skip
        assert list(finals[request_id].output_token_ids) == out[0, len(ids) :].tolist()
