"""Grammars in the engine core and the sampler: compile errors, the bitmask on constrained rows only, and a
request that finishes when its grammar does (xgrammar with the tiny model's real BPE tokenizer)."""

from __future__ import annotations

import pytest
import torch

from hpi_runtime.core.request import Request, RequestStatus
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.structured.compiler import GrammarCompiler, grammar_bitmask
from hpi_runtime.structured.params import StructuredOutputsParams, check
from hpi_runtime.worker.sampler import Sampler, SamplingBatch
from hpi_testing.tiny_model import build_tokenizer

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, len(tokenizer) + 5, frozenset({tokenizer.eos_token_id}))


@pytest.mark.parametrize("params, words", [
    (StructuredOutputsParams.json_schema({"type": "objekt"}), "invalid JSON schema"),
    (StructuredOutputsParams("regex", "(a"), "invalid regex"),
    (StructuredOutputsParams("grammar", 'root ::= "a" other'), "invalid grammar"),
])
def test_check_names_the_problem(params, words, compiler) -> None:
    with pytest.raises(ValueError, match=words) as info:
        check(params)
    assert "/project/cpp" not in str(info.value)  # the C++ location is stripped
    with pytest.raises(ValueError, match="does not compile"):
        compiler.matcher(params)


def _batch(num_rows: int, **grammar) -> SamplingBatch:
    return SamplingBatch(temperature=torch.zeros(num_rows), top_k=torch.zeros(num_rows, dtype=torch.int64),
                         top_p=torch.ones(num_rows), min_p=torch.zeros(num_rows), seeds=(None,) * num_rows,
                         num_logprobs=(None,) * num_rows, **grammar)


def test_bitmask_constrains_its_rows_and_leaves_the_others(compiler, tokenizer) -> None:
    grammar = compiler.matcher(StructuredOutputsParams.choice(CHOICES))
    bitmask = grammar_bitmask([grammar])
    allowed = {t for t in range(len(tokenizer)) if bitmask[0, t // 32] >> (t % 32) & 1}
    first_tokens = {tokenizer(c, add_special_tokens=False).input_ids[0] for c in CHOICES}
    assert first_tokens <= allowed and len(allowed) < 20  # prefixes of "yes"/"no" only

    torch.manual_seed(0)
    logits = torch.randn(3, len(tokenizer) + 5)  # wider than the tokenizer, as padded vocabularies are
    free = Sampler()(logits, _batch(3)).token_ids
    constrained = Sampler()(logits, _batch(3, grammar_rows=torch.tensor([1]), grammar_bitmask=bitmask)).token_ids
    assert constrained[0] == free[0] and constrained[2] == free[2]
    assert constrained[1] in allowed and free[1] not in allowed


def test_request_finishes_when_its_grammar_does(compiler, tokenizer) -> None:
    params = SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams.choice(CHOICES))
    request = Request("r", [5, 6], params, max_tokens=50, eos_token_ids=frozenset({tokenizer.eos_token_id}),
                      arrival_time=0.0, grammar=compiler.matcher(params.structured_outputs))
    finished = [request.append_token(t) for t in tokenizer("yes", add_special_tokens=False).input_ids]
    assert not any(finished) and not request.grammar.is_terminated
    assert request.append_token(tokenizer.eos_token_id)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.grammar.is_terminated
