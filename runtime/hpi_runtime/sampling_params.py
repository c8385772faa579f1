"""SamplingParams: how one request is decoded and when it stops. Validated here, once, at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hpi_contracts.openai_requests import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES  # OpenAI's bounds
from hpi_runtime.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (the OpenAI/vLLM parameter set).

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1 and min_p 0 disable those.
    `seed` makes sampling reproducible for this request regardless of batch composition.
    `stop` strings are matched on detokenized text and never appear in the output text.
    `logprobs` is the number of top alternatives to return per token (0: only the chosen token's logprob,
    None: no logprobs).
    `logit_bias` maps token ids to a bias added to their logits before sampling (OpenAI: -100..100, at most
    300 entries; -100 bans a token in practice, 100 all but forces it). `structured_outputs` constrains the
    output to a grammar (JSON schema, regex, choice, EBNF), enforced with a token mask at every step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt tokens, with this many alternatives
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        checks = (
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
             f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens"),
            (all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias),
             "logit_bias values must be in [-100, 100]"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias keys must be non-negative token ids"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
