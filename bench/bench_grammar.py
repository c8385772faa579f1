"""xgrammar against llguidance on CPU, for the structured-outputs grammar engine: what the choice rests on.

With the embedded SmolLM2 tokenizer (49,152 tokens), for one JSON schema and for `json_object`, it measures
each library's one-off tokenizer set-up, the compile time of the grammar (cold: a fresh compiler, no cache),
and the per-step cost the engine pays for a constrained request: filling its token bitmask and advancing the
matcher by the accepted token, walked over a valid document token by token, plus applying the mask to a
row of logits. Then, with the winner, what the engine itself adds to a step of 32 constrained requests.

    .venv/bin/python -m bench.bench_grammar
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "country": {"enum": ["FR", "IT", "ES", "DE"]}},
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@maths.uk", "tags": ["math", "engines"],
                       "address": {"street": "12 St James's Square", "city": "London", "country": "FR"}})


# The serving benchmark's schema: strings with maxLength. Both engines check a bounded string's remaining length
# token by token at run time, so some positions inside such a string cost milliseconds per mask.
BOUNDED_SCHEMA = {"type": "object", "properties": {"readings": {"type": "array", "items": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "temperature_c"]}}}, "required": ["readings"]}
BOUNDED_DOCUMENT = json.dumps({"readings": [{"city": "Paris", "temperature_c": 21},
                                            {"city": "Rome of the seven", "temperature_c": -3}]})


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def bench_xgrammar(tokenizer, vocab_size: int, token_ids: list[int]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    setup_s = time.perf_counter() - start
    compile_s = {}
    for name, make in (("json_schema", lambda c: c.compile_json_schema(json.dumps(SCHEMA))),
                       ("json_object", lambda c: c.compile_builtin_json_grammar())):
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        start = time.perf_counter()
        compiled = make(compiler)
        compile_s[name] = time.perf_counter() - start
        if name == "json_schema":
            schema_grammar = compiled
    matcher = xgr.GrammarMatcher(schema_grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    logits = torch.randn(1, vocab_size)
    fill, apply = [], []
    for token_id in token_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        apply.append(time.perf_counter() - start)
        assert matcher.accept_token(token_id), "xgrammar rejected a token of the valid document"
    return {"setup_ms": _ms(setup_s), "compile_ms": {k: _ms(v) for k, v in compile_s.items()},
            "mask_ms_median": _ms(statistics.median(fill)), "mask_ms_max": _ms(max(fill)),
            "apply_ms_median": _ms(statistics.median(apply))}


def bench_llguidance(tokenizer, vocab_size: int, token_ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup_s = time.perf_counter() - start
    compile_s = {}
    for name, grammar in (("json_schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)),
                          ("json_object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))):
        start = time.perf_counter()
        # llguidance compiles lazily: building the matcher and its first mask is the compile.
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        compile_s[name] = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    logits = torch.randn(1, vocab_size)
    fill, apply = [], []
    for token_id in token_ids:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        apply.append(time.perf_counter() - start)
        assert matcher.consume_token(token_id), matcher.get_error()
    return {"setup_ms": _ms(setup_s), "compile_ms": {k: _ms(v) for k, v in compile_s.items()},
            "mask_ms_median": _ms(statistics.median(fill)), "mask_ms_max": _ms(max(fill)),
            "apply_ms_median": _ms(statistics.median(apply))}


def bench_step_overhead(tokenizer, vocab_size: int, token_ids: list[int], num_rows: int = 32) -> dict:
    """What the engine adds to a step with `num_rows` constrained requests: the scheduler's bitmask fill
    (structured.compiler.grammar_bitmask) and the sampler's mask (apply_bitmask_ on [num_rows, V] logits, in place)."""
    from hpi_runtime.structured.compiler import GrammarCompiler, apply_bitmask_, grammar_bitmask
    from hpi_runtime.structured.params import StructuredOutputsParams

    compiler = GrammarCompiler(lambda: tokenizer, vocab_size, frozenset({tokenizer.eos_token_id}))
    grammars = [compiler.matcher(StructuredOutputsParams.json_schema(SCHEMA)) for _ in range(num_rows)]
    logits = torch.randn(num_rows, vocab_size)
    rows = torch.arange(num_rows)
    fill, apply = [], []
    for token_id in token_ids:
        start = time.perf_counter()
        bitmask = grammar_bitmask(grammars)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_bitmask_(logits, rows, bitmask)
        apply.append(time.perf_counter() - start)
        for grammar in grammars:
            assert grammar.accept_token(token_id)
    return {"rows": num_rows, "fill_ms_median": _ms(statistics.median(fill)), "fill_ms_max": _ms(max(fill)),
            "apply_ms_median": _ms(statistics.median(apply))}


def bounded_string_masks(tokenizer, vocab_size: int) -> dict:
    """Mask fill times walking BOUNDED_DOCUMENT under BOUNDED_SCHEMA, for both engines (a fresh matcher)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    token_ids = tokenizer(BOUNDED_DOCUMENT, add_special_tokens=False).input_ids
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(BOUNDED_SCHEMA))
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    ll_grammar = llguidance.LLMatcher.grammar_from_json_schema(BOUNDED_SCHEMA)
    xgr_matcher, xgr_bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab_size)
    ll_matcher = llguidance.LLMatcher(ll_tokenizer, ll_grammar)
    ll_bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    engines = {
        "xgrammar": (lambda: xgr_matcher.fill_next_token_bitmask(xgr_bitmask, 0), xgr_matcher.accept_token),
        "llguidance": (lambda: llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_bitmask, 0),
                       ll_matcher.consume_token),
    }
    results = {}
    for name, (fill, accept) in engines.items():
        times = []
        for token_id in token_ids:
            start = time.perf_counter()
            fill()
            times.append(time.perf_counter() - start)
            assert accept(token_id), f"{name} rejected a token of the bounded document"
        results[name] = {"mask_ms_median": _ms(statistics.median(times)), "mask_ms_max": _ms(max(times)),
                         "masks_over_1ms": sum(t > 1e-3 for t in times), "masks_ms_total": _ms(sum(times))}
    return results


def main() -> None:
    from transformers import AutoTokenizer

    from hpi_runtime.embedded import ensure_embedded_model

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    vocab_size = len(tokenizer)
    token_ids = tokenizer(DOCUMENT, add_special_tokens=False).input_ids
    results = {"machine": platform.processor() or platform.machine(), "vocab_size": vocab_size,
               "document_tokens": len(token_ids),
               "xgrammar": bench_xgrammar(tokenizer, vocab_size, token_ids),
               "llguidance": bench_llguidance(tokenizer, vocab_size, token_ids),
               "bounded_strings": bounded_string_masks(tokenizer, vocab_size),
               "engine_step_overhead": bench_step_overhead(tokenizer, vocab_size, token_ids)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
