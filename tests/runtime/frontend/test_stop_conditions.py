"""Stop conditions end to end through LLMEngine with the tiny BPE tokenizer: stop strings across token
boundaries (never streamed, even partially), EOS / stop token ids, min_tokens, ignore_eos, max_model_len."""

from __future__ import annotations

import pytest

from hpi_runtime.config import EngineConfig
from hpi_runtime.frontend.detokenizer import IncrementalDetokenizer
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.sampling_params import SamplingParams

TEXT = "Hello world! Stop here. STOP. The end."
PROMPT = [10, 11, 12]


@pytest.fixture
def scripted(fake_executor_cls, tokenizer):
    """An engine whose fake model "generates" the token ids of a given text, one per step."""

    def build(script: list[int], max_model_len: int = 256, **config) -> LLMEngine:
        executor = fake_executor_cls(
            64, 16, token_fn=lambda rid, pos: script[pos - len(PROMPT)] if pos - len(PROMPT) < len(script) else 0
        )
        cfg = EngineConfig(block_size=16, max_model_len=max_model_len, **config)
        return LLMEngine(cfg, executor, tokenizer, frozenset({tokenizer.eos_token_id}))

    return build


def run(engine: LLMEngine, params: SamplingParams, prompt=PROMPT):
    engine.add_request("r", list(prompt), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    assert "".join(o.text_delta for o in outputs) == outputs[-1].text
    assert [t for o in outputs for t in o.new_token_ids] == list(outputs[-1].output_token_ids)
    return outputs


def test_stop_string_is_cut_and_never_streamed_even_partially(scripted, tokenizer):
    script = tokenizer.encode(TEXT)
    outputs = run(scripted(script), SamplingParams(max_tokens=50, stop=("STOP.",)))
    final = outputs[-1]
    assert final.text == "Hello world! Stop here. "
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP.")
    for output in outputs:
        assert final.text.startswith(output.text)
    # " S" (start of " STOP.") was held back until "TOP" and "." decided it: no delta ever ended in "S".
    assert not any(o.text_delta.endswith(("S", "ST", "STOP")) for o in outputs)
    # The output token ids still include the tokens that formed the stop string.
    assert len(final.output_token_ids) == len(tokenizer.encode("Hello world! Stop here. STOP."))


def test_stop_string_spanning_three_tokens_and_earliest_match_wins(scripted, tokenizer):
    script = tokenizer.encode(TEXT)
    assert [tokenizer.decode([t]) for t in script[8:11]] == ["p", " ", "he"]
    outputs = run(scripted(script), SamplingParams(max_tokens=50, stop=("here", "p he")))
    assert outputs[-1].text == "Hello world! Sto" and outputs[-1].stop_reason == "p he"


def test_held_back_text_is_flushed_when_length_ends_the_request(scripted, tokenizer):
    script = tokenizer.encode(TEXT)
    assert tokenizer.decode(script[:8]) == "Hello world! Sto"
    outputs = run(scripted(script), SamplingParams(max_tokens=8, stop=("Stopper",)))
    assert outputs[-2].text == "Hello world! "  # "S" held back: it could begin "Stopper"
    assert outputs[-1].text == "Hello world! Sto" and outputs[-1].finish_reason == "length"


def test_eos_and_stop_token_ids_respect_min_tokens_and_ignore_eos(scripted, tokenizer):
    eos = tokenizer.eos_token_id
    hello = tokenizer.encode("Hello")
    script = [*hello, eos, *hello, eos, *hello]
    out = run(scripted(script), SamplingParams(max_tokens=20))[-1]
    assert out.output_token_ids == (*hello, eos) and out.stop_reason is None and out.text == "Hello"  # as vLLM
    out = run(scripted(script), SamplingParams(max_tokens=20, stop_token_ids=(eos,)))[-1]
    assert out.finish_reason == "stop" and out.stop_reason == eos  # asked for explicitly: named
    out = run(scripted(script), SamplingParams(max_tokens=20, min_tokens=len(hello) + 2))[-1]
    assert out.output_token_ids == (*hello, eos, *hello, eos) and out.finish_reason == "stop"
    out = run(scripted(script), SamplingParams(max_tokens=len(script), ignore_eos=True))[-1]
    assert out.finish_reason == "length" and len(out.output_token_ids) == len(script)
    stop_id = hello[1]
    out = run(scripted(script), SamplingParams(max_tokens=20, stop_token_ids=(stop_id,)))[-1]
    assert out.output_token_ids == tuple(hello[:2]) and out.stop_reason == stop_id


def test_min_tokens_also_defers_stop_strings(scripted, tokenizer):
    script = tokenizer.encode(TEXT)
    out = run(scripted(script), SamplingParams(max_tokens=50, stop=("Hel",), min_tokens=3))[-1]
    # "Hel" appears within the first min_tokens tokens, so it does not stop (nor cut) the text.
    assert out.finish_reason == "length" and out.text.startswith("Hello world!")


def test_max_tokens_is_capped_by_max_model_len(scripted, tokenizer):
    script = tokenizer.encode(TEXT)
    outputs = run(scripted(script, max_model_len=8), SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(outputs[-1].output_token_ids) == 8 - len(PROMPT) and outputs[-1].finish_reason == "length"


def test_special_tokens_are_skipped_in_text_unless_asked(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + tokenizer.encode(" end")
    for skip, expected in ((True, "Hello end"), (False, "Hello<|im_start|> end")):
        detok = IncrementalDetokenizer(tokenizer, PROMPT, SamplingParams(skip_special_tokens=skip))
        for token_id in ids:
            detok.append(token_id)
        assert detok.text == expected


def test_slow_tokenizer_fallback_decodes_multibyte_text(tokenizer):
    class SlowTokenizer:  # no backend_tokenizer: forces the prefix/read-offset path
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "Hello é€ 你好 world"
    detok = IncrementalDetokenizer(SlowTokenizer(), tokenizer.encode("Say:"), SamplingParams(stop=("wor",)))
    pieces = []
    for token_id in tokenizer.encode(text):
        stop = detok.append(token_id)
        pieces.append(detok.emit(stop is not None))
        if stop:
            break
    assert "".join(pieces) == detok.text == "Hello é€ 你好 "
