"""Qwen2-VL through the real engine (scheduler, encoder cache, KV cache manager, runner) against transformers:
logits at every step and greedy tokens for prompts with 0, 1 and 2 images, an image's placeholder run split
across prefill chunks, prefix-cache hits keyed by the image, and encoder-cache eviction under a small budget."""

from __future__ import annotations

import pytest
import torch

from hpi_testing.multimodal import ATOL, GREEDY
from hpi_testing.multimodal import chat_prompt as _prompt
from hpi_testing.multimodal import make_engine as _engine
from hpi_testing.multimodal import record_logits as _record_logits
from hpi_testing.multimodal import run_to_end as _run
from hpi_testing.tiny_vlm import random_image


def _hf_inputs(token_ids: list[int], mm_inputs, image_token_id: int) -> dict:
    ids = torch.tensor([token_ids])
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_token_id).int()}
    if mm_inputs:
        inputs["pixel_values"] = torch.cat([torch.from_numpy(mm.pixel_values) for mm in mm_inputs])
        inputs["image_grid_thw"] = torch.tensor([mm.grid_thw for mm in mm_inputs])
    return inputs


def _hf_greedy(hf_vlm, prompt_ids, mm_inputs, num_tokens: int) -> list[int]:
    inputs = _hf_inputs(prompt_ids, mm_inputs, hf_vlm.config.image_token_id)
    with torch.no_grad():
        out = hf_vlm.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=num_tokens,
                              do_sample=False)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def test_logits_and_greedy_tokens_match_transformers_with_0_1_2_images(tiny_vlm_dir, hf_vlm) -> None:
    engine = _engine(tiny_vlm_dir)
    records = _record_logits(engine)
    requests = {
        "text": _prompt(engine, tiny_vlm_dir, "Hello world, how are you?", []),
        "one": _prompt(engine, tiny_vlm_dir, "What is this?", [random_image(70, 60, seed=1)]),
        "two": _prompt(engine, tiny_vlm_dir, "Compare them.", [random_image(56, 56, seed=2),
                                                               random_image(112, 84, seed=3)]),  # fmt: skip
    }
    assert [len(mm) for _, mm in requests.values()] == [0, 1, 2]
    finals = _run(engine, requests)
    mm_of = {request_id: mm for request_id, (_, mm) in requests.items()}
    assert len(records) == 3 * GREEDY.max_tokens  # one sampled row per request per step
    for request_id, token_ids, logits in records:
        with torch.no_grad():
            expected = hf_vlm(**_hf_inputs(token_ids, mm_of[request_id], hf_vlm.config.image_token_id)).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4, msg=lambda m, r=request_id: f"{r}: {m}")
    for request_id, (ids, mm_inputs) in requests.items():
        assert list(finals[request_id].output_token_ids) == _hf_greedy(hf_vlm, ids, mm_inputs, GREEDY.max_tokens)


def test_a_placeholder_run_split_across_prefill_chunks_keeps_its_rows(tiny_vlm_dir, hf_vlm) -> None:
    # 5 tokens per step: the 16 placeholders of a 112x112 image span five chunks; the image is encoded once.
    engine = _engine(tiny_vlm_dir, max_num_batched_tokens=5, encoder_cache_size=32, max_num_encoder_input_tokens=32)
    records = _record_logits(engine)
    ids, mm_inputs = _prompt(engine, tiny_vlm_dir, "Describe it.", [random_image(112, 112, seed=4)])
    assert mm_inputs[0].length == 16 and mm_inputs[0].offset % 5 != 0  # starts inside a chunk
    finals = _run(engine, {"split": (ids, mm_inputs)})
    assert engine.executor.runner.multimodal.num_images_encoded == 1
    assert list(finals["split"].output_token_ids) == _hf_greedy(hf_vlm, ids, mm_inputs, GREEDY.max_tokens)
    _, token_ids, logits = records[0]
    with torch.no_grad():
        expected = hf_vlm(**_hf_inputs(token_ids, mm_inputs, hf_vlm.config.image_token_id)).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_prefix_cache_hits_the_same_image_and_misses_a_changed_pixel(tiny_vlm_dir, hf_vlm) -> None:
    engine = _engine(tiny_vlm_dir)
    image = random_image(112, 112, seed=5)
    changed = image.copy()
    changed.putpixel((60, 60), tuple(255 - c for c in image.getpixel((60, 60))))
    text = "A long question about this picture, so that the prompt fills several blocks of the cache."
    first = _prompt(engine, tiny_vlm_dir, text, [image])
    again = _prompt(engine, tiny_vlm_dir, text, [image])
    other = _prompt(engine, tiny_vlm_dir, text, [changed])
    assert first[0] == other[0]  # the same token ids: only the image hash tells them apart
    image_start = first[1][0].offset
    block_size = 16
    cached = {}
    for name, request in (("first", first), ("again", again), ("other", other)):
        cached[name] = _run(engine, {name: request})[name]
    assert cached["first"].num_cached_prompt_tokens == 0
    # Every full block of the prompt but the last (at least one token runs to sample the first output).
    assert cached["again"].num_cached_prompt_tokens == (len(first[0]) - 1) // block_size * block_size
    # The changed image hits only the blocks before its placeholders.
    assert cached["other"].num_cached_prompt_tokens == image_start // block_size * block_size
    assert list(cached["again"].output_token_ids) == list(cached["first"].output_token_ids)
    assert list(cached["other"].output_token_ids) == _hf_greedy(hf_vlm, *other, GREEDY.max_tokens)


def test_encoder_cache_evicts_under_a_small_budget_and_hits_a_recurring_image(tiny_vlm_dir, hf_vlm) -> None:
    # Room for one 16-row image: a prompt with two runs them in turn, evicting the first for the second.
    engine = _engine(tiny_vlm_dir, encoder_cache_size=16, max_num_encoder_input_tokens=16)
    a, b = random_image(112, 112, seed=6), random_image(112, 112, seed=7)
    both = _prompt(engine, tiny_vlm_dir, "Which differs?", [a, b])
    finals = _run(engine, {"both": both})
    assert list(finals["both"].output_token_ids) == _hf_greedy(hf_vlm, *both, GREEDY.max_tokens)
    multimodal = engine.executor.runner.multimodal
    assert multimodal.num_images_encoded == 2 and set(multimodal.encoder_cache) == {both[1][1].mm_hash}
    _run(engine, {"b-again": _prompt(engine, tiny_vlm_dir, "And this one?", [b])})  # cached: no encoding
    assert multimodal.num_images_encoded == 2
    _run(engine, {"a-again": _prompt(engine, tiny_vlm_dir, "And this one?", [a])})  # evicted: encoded again
    assert multimodal.num_images_encoded == 3 and set(multimodal.encoder_cache) == {both[1][0].mm_hash}
    stats = engine.get_stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (4, 1)
    assert stats.encoder_cache_usage == 0.0  # nothing running holds an image


def test_images_a_text_model_or_the_encoder_limit_cannot_take_are_refused(tiny_vlm_dir, tiny_model_dir) -> None:
    engine = _engine(tiny_vlm_dir, encoder_cache_size=8, max_num_encoder_input_tokens=8)
    ids, mm_inputs = _prompt(engine, tiny_vlm_dir, "Too big?", [random_image(112, 112, seed=8)])
    with pytest.raises(ValueError, match="exceeds the encoder's limit of 8"):
        engine.add_request("big", ids, GREEDY, mm_inputs=mm_inputs)
    text_engine = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match="takes no images"):
        text_engine.add_request("img", [1, 2, 3] * 8, GREEDY, mm_inputs=mm_inputs[:1])


def test_the_bf16_path_runs_the_vision_tower_and_decoder(tiny_vlm_dir, hf_vlm) -> None:
    """bf16 weights and activations (emulated where the CPU lacks bf16): the image's rows reach the decoder in
    bf16 and the first token's logits stay near transformers' fp32 ones."""
    engine = _engine(tiny_vlm_dir, dtype="bfloat16")
    records = _record_logits(engine)
    ids, mm_inputs = _prompt(engine, tiny_vlm_dir, "What is this?", [random_image(70, 60, seed=1)])
    finals = _run(engine, {"bf16": (ids, mm_inputs)})
    assert len(finals["bf16"].output_token_ids) == GREEDY.max_tokens
    assert next(engine.executor.runner.model.visual.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        expected = hf_vlm(**_hf_inputs(ids, mm_inputs, hf_vlm.config.image_token_id)).logits[0, -1]
    torch.testing.assert_close(records[0][2], expected, atol=0.1, rtol=0.05)


def test_int8_quantizes_the_decoder_and_leaves_the_vision_tower_in_float(tiny_vlm_dir) -> None:
    from hpi_runtime.quantization.linear import QuantizedLinear

    engine = _engine(tiny_vlm_dir, quantization="int8")
    model = engine.executor.runner.model
    assert any(isinstance(m, QuantizedLinear) for m in model.model.modules())
    assert not any(isinstance(m, QuantizedLinear) for m in model.visual.modules())
    assert {p.dtype for p in model.visual.parameters()} == {torch.float32}
    finals = _run(engine, {"q": _prompt(engine, tiny_vlm_dir, "What is this?", [random_image(70, 60, seed=1)])})
    assert len(finals["q"].output_token_ids) == GREEDY.max_tokens
