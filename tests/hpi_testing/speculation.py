"""What the speculative-decoding tests run on both sides of a comparison (tests/runtime/spec_decode): the engine
settings, prompts that repeat themselves (so drafts get accepted), one request per prompt with a different stop
each, and the outcome of a run as the comparison reads it."""

from __future__ import annotations

from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams

OPTIONS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 1 << 22, "enforce_eager": True}
PROMPTS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of",
    "one two three four five six seven one two three",
    "def add(a, b):\n    return a + b\n\nprint(add(",
    "Hello world! How are you today? Hello world! How",
]


def request_params(max_tokens: int = 48, **overrides) -> list[SamplingParams]:
    """One request per prompt, with different stops, so speculation must never emit past any of them."""
    base = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **overrides}
    return [
        SamplingParams(**base),
        SamplingParams(**{**base, "max_tokens": 7}),
        SamplingParams(**{**base, "logprobs": 2}),
        SamplingParams(**{**base, "stop": ["e"], "ignore_eos": False}),
    ]


def outcomes(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    """PROMPTS run with `params`: per request its tokens, text, finish reason and logprobs (4 decimals)."""
    outputs = llm.generate(PROMPTS, params)
    return [(o.output_token_ids, o.text, o.finish_reason, [(lp.token_id, round(lp.logprob, 4)) for lp in
             o.new_logprobs]) for o in outputs]  # fmt: skip
