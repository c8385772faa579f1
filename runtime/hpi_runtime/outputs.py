"""What the engine hands back per request: `RequestOutput`, cumulative plus the delta of this step."""

from __future__ import annotations

from dataclasses import dataclass

from hpi_runtime.core.interface import TokenLogprobs

FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"  # client went away or the request was cancelled


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # cumulative
    new_token_ids: tuple[int, ...]  # produced since the previous RequestOutput for this request
    text: str  # cumulative detokenized output, stop string (and anything after it) removed
    text_delta: str  # new text since the previous RequestOutput; never part of a possible stop string
    finished: bool
    finish_reason: str | None = None  # FINISH_STOP / FINISH_LENGTH / FINISH_ABORT
    stop_reason: str | int | None = None  # the matched stop string or requested stop token id; None for EOS
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token when SamplingParams.logprobs set
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # time.monotonic() when the engine received the request
    first_scheduled_time: float | None = None  # time.monotonic() when it was first scheduled (queue time)
