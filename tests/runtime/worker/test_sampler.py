"""The sampler on hand-made logits: greedy, filters, seeds, penalties, banned tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from bench.bench_sampler import filter_by_full_sort
from hpi_runtime.worker.sampler import Sampler, SamplingBatch, apply_top_k_top_p_min_p, mix_seed

VOCAB = 32


def _batch(num_rows: int, **columns) -> SamplingBatch:
    def col(name: str, default: float, dtype=torch.float32) -> torch.Tensor:
        value = columns.pop(name, default)
        return value if isinstance(value, torch.Tensor) else torch.full((num_rows,), value, dtype=dtype)

    return SamplingBatch(
        temperature=col("temperature", 1.0),
        top_k=col("top_k", 0, torch.int64),
        top_p=col("top_p", 1.0),
        min_p=col("min_p", 0.0),
        seeds=columns.pop("seeds", (None,) * num_rows),
        num_logprobs=columns.pop("num_logprobs", (None,) * num_rows),
        **columns,
    )


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = _logits(6)
    argmax = logits.argmax(-1).tolist()
    assert Sampler()(logits, _batch(6, temperature=0.0)).token_ids == argmax
    for filters in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert Sampler()(logits, _batch(6, **filters)).token_ids == argmax


def test_greedy_ties_pick_the_first_index() -> None:
    # Rows whose maximum repeats (as bf16 logits make common): the first index, as argmax gives, on every row of a
    # vocabulary-sized batch; the row with several maxima puts one early and one late, where a reduction split over
    # threads could find the late one first.
    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(3))
    top = logits.max().item() + 1.0
    logits[2, [40000, 777, 31]] = top
    logits[5, [49151, 12000]] = top
    token_ids = Sampler()(logits, _batch(8, temperature=0.0)).token_ids
    assert token_ids == logits.argmax(-1).tolist()
    assert token_ids[2] == 31 and token_ids[5] == 12000


def test_filters_restrict_the_support() -> None:
    logits = _logits(1).expand(400, -1).contiguous()
    top4 = set(logits[0].topk(4).indices.tolist())
    assert set(Sampler(seed=1)(logits, _batch(400, top_k=4)).token_ids) <= top4
    probs = logits[0].softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_probs.cumsum(0) < 0.6).sum()) + 1].tolist())
    assert set(Sampler(seed=2)(logits, _batch(400, top_p=0.6)).token_ids) <= nucleus
    above_min_p = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    assert set(Sampler(seed=3)(logits, _batch(400, min_p=0.3)).token_ids) <= above_min_p


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0] + [-30.0] * (VOCAB - 3)]).expand(6000, -1).contiguous()
    tokens = torch.tensor(Sampler(seed=0)(logits, _batch(6000, temperature=1.0)).token_ids)
    observed = torch.bincount(tokens, minlength=3)[:3].float() / 6000
    torch.testing.assert_close(observed, logits[0, :3].softmax(-1), atol=0.03, rtol=0)


@pytest.mark.parametrize("vocab", [49_152, 50_000])  # SmolLM2's (whole blocks of the draw), one with a tail
def test_a_large_vocabulary_is_sampled_in_proportion_to_the_end(vocab: int) -> None:
    """Half the mass on the last token, the rest spread evenly, so a draw in a cumulative sum that lost precision
    over the vocabulary (or mishandled the blocks of the two-level search) would miss the last token's share."""
    logits = torch.zeros(1, vocab)
    logits[0, -1] = torch.log(torch.tensor(vocab - 1.0))  # p(last) = (V - 1) / (2 (V - 1)) = 0.5
    logits[0, :100] = -float("inf")  # never drawn
    tokens = torch.tensor(Sampler(seed=4)(logits.expand(1500, -1).contiguous(), _batch(1500)).token_ids)
    assert tokens.min() >= 100
    share = (tokens == vocab - 1).float().mean().item()
    expected = (vocab - 1) / (2 * vocab - 2 - 100)
    assert abs(share - expected) < 0.03, share
    # Uniform: 1500 draws from `vocab` tokens hit ~1480 distinct ones, spread over each block's positions.
    uniform = torch.tensor(Sampler(seed=5)(torch.zeros(1500, vocab), _batch(1500)).token_ids)
    assert len(set(uniform.tolist())) > 1400
    assert abs(uniform.float().mean().item() / (vocab - 1) - 0.5) < 0.03


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _logits(5)
    alone = Sampler(seed=1)(logits[2:3], _batch(1, seeds=(mix_seed(7, 0),))).token_ids
    seeds = (None, mix_seed(9, 0), mix_seed(7, 0), None, mix_seed(7, 3))
    batched = Sampler(seed=2)(logits, _batch(5, seeds=seeds)).token_ids
    assert batched[2] == alone[0]
    flat = torch.zeros(64, VOCAB)  # uniform: draws are decided by the noise alone
    draws = [Sampler()(flat, _batch(64, seeds=(mix_seed(s, 0),) * 64)).token_ids for s in (7, 7, 8)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    assert mix_seed(7, 0) != mix_seed(7, 1) != mix_seed(8, 0)


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [-9.0] * (VOCAB - 4)])
    greedy = {"temperature": 0.0}
    penalties = {
        "presence_penalty": torch.zeros(1),
        "frequency_penalty": torch.zeros(1),
        "repetition_penalty": torch.ones(1),
        "prompt_token_ids": ((),),
        "output_token_ids": ((),),
    }
    repeated = {**penalties, "repetition_penalty": torch.tensor([4.0]), "prompt_token_ids": ((0,),)}
    assert Sampler()(logits, _batch(1, **greedy, **repeated)).token_ids == [2]  # 2.0 / 4 < 1.0
    frequency = {**penalties, "frequency_penalty": torch.tensor([0.6]), "output_token_ids": ((0, 0),)}
    assert Sampler()(logits, _batch(1, **greedy, **frequency)).token_ids == [2]  # 2.0 - 1.2 < 1.0
    # Presence subtracts once per seen token, not per occurrence: 2.0 - 0.6 > 1.0 keeps token 0 on top
    # (a per-count 2 x 0.6 would not), and 2.0 - 1.5 < 1.0 moves the argmax, which only applying it can.
    presence = {**penalties, "presence_penalty": torch.tensor([0.6]), "output_token_ids": ((0, 0),)}
    assert Sampler()(logits, _batch(1, **greedy, **presence)).token_ids == [0]
    strong_presence = {**presence, "presence_penalty": torch.tensor([1.5])}
    assert Sampler()(logits, _batch(1, **greedy, **strong_presence)).token_ids == [2]


def test_banned_tokens_and_logprobs() -> None:
    logits = _logits(3)
    argmax = logits.argmax(-1).tolist()
    banned = ((argmax[0],), (), ())
    out = Sampler()(logits, _batch(3, temperature=0.0, banned_token_ids=banned, num_logprobs=(2, None, 0)))
    assert out.token_ids[0] != argmax[0] and out.token_ids[1:] == argmax[1:]
    # Logprobs of the model (not of the filtered logits), computed here in float64 from the definition.
    expected = logits.double() - logits.double().exp().sum(-1, keepdim=True).log()
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert abs(first.logprob - expected[0, first.token_id].item()) < 1e-5
    top_values, top_ids = expected[0].topk(2)
    assert [t for t, _ in first.top] == top_ids.tolist()
    torch.testing.assert_close(
        torch.tensor([v for _, v in first.top], dtype=torch.float64), top_values, atol=1e-5, rtol=0
    )
    assert out.logprobs[1] is None and out.logprobs[2].top == ()


def test_filters_over_a_large_vocabulary_keep_the_full_sorts_sets() -> None:
    """Rows peaked (a nucleus of tens of tokens) and flat (one of thousands, past the first candidates), with
    top-k below and above the first candidates, top-p, min-p, and none at all: the same kept tokens and values as
    a full sort, and a row without filters keeps every logit."""
    vocab, generator = 5000, torch.Generator().manual_seed(11)
    scales = torch.tensor([8.0, 8.0, 0.3, 0.3, 8.0, 0.3, 1.0, 1.0, 0.05])
    logits = torch.randn(len(scales), vocab, generator=generator) * scales[:, None]
    top_k = torch.tensor([0, 40, 0, 700, 0, 0, 300, 0, 0])
    top_p = torch.tensor([0.95, 0.9, 0.95, 0.8, 1.0, 1.0, 0.99, 1.0, 0.999])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.3, 0.0, 0.0, 0.0])
    batch = _batch(len(scales), top_k=top_k, top_p=top_p, min_p=min_p)
    got = apply_top_k_top_p_min_p(logits, batch)
    expected = filter_by_full_sort(logits, batch)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    kept = (~torch.isinf(got)).sum(dim=1).tolist()
    assert kept[2] > 256 and kept[5] > 256 and kept[7] == vocab  # flat rows' sets reach past the first candidates
    assert torch.equal(got[7], logits[7])
