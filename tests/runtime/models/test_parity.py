"""Logits parity with transformers on tiny random models, at every step of paged, batched generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import HandScheduler

ATOL = 2e-4  # fp32; observed differences are ~1e-6


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _run_and_compare(runner, hf_model, scheduler: HandScheduler, num_steps: int, events=None) -> int:
    """Drive `num_steps` greedy steps; compare every sampled row with transformers. Returns rows checked."""
    checked = 0
    for step in range(num_steps):
        if events and step in events:
            events[step](scheduler)
        logits = runner.forward(scheduler.schedule())
        for row, request_id in enumerate(logits.request_ids):
            ids = torch.tensor([runner.input_batch.request_token_ids(request_id)])
            with torch.no_grad():
                expected = hf_model(ids).logits[0, -1]
            torch.testing.assert_close(
                logits.logits[row],
                expected,
                atol=ATOL,
                rtol=1e-4,
                msg=lambda m, r=request_id, s=step: f"{r} at step {s}: {m}",
            )
            checked += 1
        output = runner.sample(logits)
        for request_id, tokens in output.sampled_token_ids.items():
            for token in tokens:
                scheduler.append(request_id, token)
    return checked


VARIANTS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"num_heads": 6, "num_kv_heads": 2, "hidden_size": 96}),
    "llama3-rope-untied": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
}


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ragged_batch_matches_transformers(variant, chunk_size, tiny_model_factory, make_runner) -> None:
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(arch, **overrides)
    runner, hf_model = make_runner(model_dir), _hf_model(model_dir)
    scheduler = HandScheduler(num_blocks=64, block_size=8, chunk_size=chunk_size)
    for i, prompt in enumerate(_prompts(runner.model.config.vocab_size, [5, 19, 1, 33])):
        scheduler.add(f"r{i}", prompt)

    def late_arrival(s: HandScheduler) -> None:
        s.add("late", _prompts(runner.model.config.vocab_size, [12], seed=1)[0])

    checked = _run_and_compare(runner, hf_model, scheduler, num_steps=10, events={3: late_arrival})
    assert checked >= 30


def test_prefix_hits_preemption_and_dirty_blocks(tiny_model_dir, make_runner) -> None:
    runner, hf_model = make_runner(tiny_model_dir, num_blocks=40), _hf_model(tiny_model_dir)
    vocab_size = runner.model.config.vocab_size
    shared, tail_a, tail_b = _prompts(vocab_size, [24, 5, 9], seed=2)
    scheduler = HandScheduler(num_blocks=40, block_size=8, chunk_size=16)
    scheduler.add("a", shared + tail_a)
    scheduler.add("other", _prompts(vocab_size, [30], seed=3)[0])

    def prefix_hit(s: HandScheduler) -> None:
        s.add("b", shared + tail_b, shared_prefix_of="a", num_shared_blocks=3)  # 24 cached tokens

    def preempt_other(s: HandScheduler) -> None:
        s.preempt("other")  # recomputed from scratch into (dirty) reused blocks

    def finish_a(s: HandScheduler) -> None:
        s.finish("a")  # b still holds the shared blocks
        s.add("c", _prompts(vocab_size, [17], seed=4)[0])  # reuses a's freed blocks

    events = {3: prefix_hit, 5: preempt_other, 8: finish_a}
    checked = _run_and_compare(runner, hf_model, scheduler, num_steps=14, events=events)
    assert checked >= 25
    assert "a" not in runner.input_batch
