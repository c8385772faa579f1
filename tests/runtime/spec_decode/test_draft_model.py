"""Draft-model speculation with real tiny models (fp32): greedy output token for token as without it (another
tiny model as the draft, concurrent requests with stops and logprobs), the draft's own KV rolled back and
rebuilt under a pool small enough to preempt (the target drafting for itself must have every draft
accepted: any stale or misplaced draft KV would make it propose something else), sampled output keeping the
target distribution (rejection sampling against the draft's q: alone, and end to end with a chi-square
test), and drafts that cannot speak for the target refused at start."""

from __future__ import annotations

import collections
import json
import shutil

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.spec_decode.verify import rejection_sample
from hpi_runtime.structured.params import StructuredOutputsParams
from hpi_testing.speculation import OPTIONS, outcomes, request_params
from hpi_testing.tiny_model import build_tiny_model


def _draft_config(draft_dir, **extra) -> dict:
    # Kept on at every batch size: the measured step times may (rightly) turn it off on a loaded machine.
    return {"model": str(draft_dir), "num_speculative_tokens": 4, "disable_by_batch_size": 64, **extra}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another tiny Llama with the same tokenizer: one layer, other random weights."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "llama", num_layers=1, seed=1)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    with LLM(tiny_model_dir, **OPTIONS) as llm:
        yield llm


def test_greedy_output_is_identical_with_another_model_as_draft(plain, tiny_model_dir, draft_dir) -> None:
    expected = outcomes(plain, request_params(max_tokens=40))
    with LLM(tiny_model_dir, speculative_config=_draft_config(draft_dir), **OPTIONS) as llm:
        assert outcomes(llm, request_params(max_tokens=40)) == expected
        stats = llm.engine.get_stats()
        # A draft model's tokens are made past the grammar's reach: a constrained request does not speculate.
        choice = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams.choice(["red", "blue"]))
        assert llm.generate(["The capital of"], choice)[0].text in ("red", "blue")
        assert llm.engine.get_stats().spec_num_drafts == stats.spec_num_drafts
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_self_draft_accepts_every_draft_under_preemption(plain, tiny_model_dir) -> None:
    """20 blocks of 8 tokens (both caches) for four requests growing to ~60 tokens: requests are preempted and
    recomputed, and the draft catches up over accepted tokens each step. The target as its own draft sees
    exactly the target's context only if its KV is right at every position, so every draft is accepted."""
    params = request_params()
    expected = [run[:3] for run in outcomes(plain, params)]
    options = {**OPTIONS, "max_model_len": 128, "block_size": 8, "kv_admission_watermark": 0.0,
               "kv_cache_memory_bytes": 2 * 20 * 8 * 512}  # fmt: skip
    with LLM(tiny_model_dir, speculative_config=_draft_config(tiny_model_dir), **options) as llm:
        assert [run[:3] for run in outcomes(llm, params)] == expected
        stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_draft_tokens > 50 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """One draft drawn from q, verified against p: the emitted first token is distributed as p."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    generator = torch.Generator().manual_seed(0)
    num_draws = 4000
    drafts = torch.multinomial(q[0], num_draws, replacement=True, generator=generator).tolist()
    first = collections.Counter(rejection_sample([d], q, p, 0, generator)[0] for d in drafts)
    observed = [first[t] for t in range(4)]
    assert chisquare(observed, (p[0] * num_draws).tolist()).pvalue > 1e-3
    assert chisquare(observed, (q[0] * num_draws).tolist()).pvalue < 1e-6  # the test can tell q from p


def test_sampled_tokens_keep_the_target_distribution(plain, tiny_model_dir, draft_dir) -> None:
    """400 unseeded draws of 4 tokens with and without a draft model (its drafts drawn from its own q and
    rejection-sampled): whether each token repeats the one before is distributed alike (chi-square), and
    drafts were accepted, so sampled requests really speculated."""
    prompt_ids = plain.tokenizer("one two three four five six seven one two three").input_ids
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    num_draws = 400

    def draws(llm: LLM) -> collections.Counter:
        outputs = llm.generate([prompt_ids] * num_draws, params)
        return collections.Counter((t[2] == t[1], t[3] == t[2]) for t in (o.output_token_ids for o in outputs))

    expected = draws(plain)
    config = _draft_config(draft_dir, num_speculative_tokens=3, disable_by_batch_size=num_draws)
    with LLM(tiny_model_dir, speculative_config=config, **OPTIONS) as llm:
        speculative = draws(llm)
        stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 100 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    categories = sorted(set(expected) | set(speculative))
    assert len(categories) >= 3
    table = [[expected[c] for c in categories], [speculative[c] for c in categories]]
    assert chi2_contingency(table).pvalue > 1e-3


def test_a_missing_draft_is_refused(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative config: draft model .* does not exist"):
        LLM(tiny_model_dir, speculative_config=_draft_config(tmp_path / "nowhere"), **OPTIONS)


def _edited_copy(src, dst, file: str, edit) -> str:
    shutil.copytree(src, dst)
    path = dst / file
    path.write_text(edit(path.read_text()))
    return str(dst)


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("config.json", lambda t: json.dumps({**json.loads(t), "vocab_size": 512}), "vocabulary of 512 tokens"),
        ("tokenizer.json", lambda t: t.replace("<|im_end|>", "<|im_stop|>"), "another tokenizer vocabulary"),
        (
            "config.json",
            lambda t: json.dumps({**json.loads(t), "max_position_embeddings": 64}),
            "covers 64 positions, fewer than max_model_len 256",
        ),
    ],
    ids=["vocab-size", "tokenizer", "context"],
)
def test_a_draft_that_cannot_speak_for_the_target_is_refused(tiny_model_dir, draft_dir, tmp_path, file, edit,
                                                             message) -> None:  # fmt: skip
    bad = _edited_copy(draft_dir, tmp_path / "draft", file, edit)
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        LLM(tiny_model_dir, speculative_config=_draft_config(bad), **OPTIONS)
