"""What the engine hands back per request: `RequestOutput`, the delta of this step plus (by kind) the whole."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hpi_runtime.core.interface import TokenLogprobs

FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"  # client went away or the request was cancelled


class RequestOutputKind(enum.Enum):
    """Whether intermediate outputs repeat everything so far (as vLLM's RequestOutputKind).

    Rebuilding the whole output for every request every step costs O(length) per token; a streaming server
    needs only the deltas, and the whole once, at the end."""

    CUMULATIVE = "cumulative"  # every output carries output_token_ids and text so far (the offline API)
    DELTA = "delta"  # intermediate outputs carry only the delta; the final one carries the whole too


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Cumulative: every output of a CUMULATIVE request, only the final one of a DELTA request (else empty).
    output_token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]  # produced since the previous RequestOutput for this request
    text: str  # as output_token_ids: the detokenized output so far, stop string (and anything after it) removed
    text_delta: str  # new text since the previous RequestOutput; never part of a possible stop string
    finished: bool
    finish_reason: str | None = None  # FINISH_STOP / FINISH_LENGTH / FINISH_ABORT
    stop_reason: str | int | None = None  # the matched stop string or requested stop token id; None for EOS
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token when SamplingParams.logprobs set
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # time.monotonic() when the engine received the request
    first_scheduled_time: float | None = None  # time.monotonic() when it was first scheduled (queue time)
    # Logprobs of prompt tokens 1.. (token 0 has none) when asked for; on every output that carries the whole
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
