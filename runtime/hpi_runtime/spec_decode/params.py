"""`--speculative-config` (vLLM's JSON keys) parsed and checked once, before any weight is read.

Accepted: `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}`
(prompt lookup: propose the k tokens that followed the latest earlier occurrence of the sequence's last
a..b tokens) and `{"method": "suffix", "num_speculative_tokens": k}` (the longest suffix match over the
prompt and output, whatever its length). `disable_by_batch_size` (vLLM's) turns speculation off above that
many running requests; without it the engine decides from its measured step times (policy.py).
`"suffix_decoding_max_cached_requests": N` (vLLM's key; 0 here by default, 10000 in vLLM) lets `suffix` draft
from the N most recent finished requests too (Arctic Inference's global cache).
`{"model": DIR, "num_speculative_tokens": k}` (or `"method": "draft_model"` with a `model`) is draft-model
speculation: a small model sharing the target's tokenizer proposes k tokens autoregressively each step
(draft_model.py); whether it shares the vocabulary is checked where the model is resolved
(engine_factory.py), since that needs its files. Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
         "model", "suffix_decoding_max_cached_requests")  # fmt: skip
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeParams:
    """A checked speculative-decoding config."""

    method: str
    num_speculative_tokens: int  # the most draft tokens verified per request and step
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model (a directory or a model name), with method "draft_model"
    # suffix: recent finished requests searched for drafts too (Arctic Inference's global cache); 0: none
    suffix_decoding_max_cached_requests: int = 0


def _int(config: Mapping[str, Any], key: str, default: int | None, low: int = 1) -> int | None:
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative config: {key} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"speculative config: {key} must be at least {low}, got {value}")
    return value


def parse_speculative_config(config: str | Mapping[str, Any]) -> SpeculativeParams:
    """JSON text or a dict -> SpeculativeParams; ValueError with the reason for anything else."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"speculative config must be a JSON object, got {config!r}")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative config: unknown key(s) {unknown}; known: {list(_KEYS)}")
    model = config.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"speculative config: 'model' must be a model directory or name, got {model!r}")
    method = config.get("method", "draft_model" if model is not None else None)
    if method is None:
        raise ValueError(f"speculative config: 'method' is required, one of {list(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"speculative config: unknown method {method!r}; supported: {list(METHODS)}")
    if (method == "draft_model") != (model is not None):
        raise ValueError("speculative config: a draft 'model' goes with method 'draft_model' (the default when a "
                         f"model is given), got method {method!r} and model {model!r}")  # fmt: skip
    if "num_speculative_tokens" not in config:
        raise ValueError("speculative config: 'num_speculative_tokens' is required")
    k = _int(config, "num_speculative_tokens", None)
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                         f"got {k}")  # fmt: skip
    # vLLM's rule: one of the two bounds given sets the other; neither: 1..5 here (any repeat may be proposed).
    low = _int(config, "prompt_lookup_min", None)
    high = _int(config, "prompt_lookup_max", None)
    low, high = (low or high or 1), (high or low or 5)
    if low > high:
        raise ValueError(f"speculative config: prompt_lookup_min ({low}) is above prompt_lookup_max ({high})")
    num_cached = _int(config, "suffix_decoding_max_cached_requests", 0, low=0)
    if num_cached and method != "suffix":
        raise ValueError(f"speculative config: suffix_decoding_max_cached_requests goes with method 'suffix', "
                         f"not {method!r}")  # fmt: skip
    return SpeculativeParams(method, k, low, high, _int(config, "disable_by_batch_size", None), model, num_cached)
