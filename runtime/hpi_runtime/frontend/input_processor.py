"""The one place that checks a request before it reaches the engine core, and builds its `EngineCoreRequest`.

Both frontends use it: the HTTP server checks each choice's prompt and max_tokens here before it answers
anything (a `RequestError` becomes a 400 carrying `param` and `code`), and `make_core_request` checks again
what every caller of `AsyncLLM` and `LLMEngine` sends. Request-id uniqueness belongs to the
`OutputProcessor`, which knows every live request; the engine core trusts what passed here.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.engine_core import check_images
from hpi_runtime.core.engine_io import EngineCoreRequest
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.sampling_params import SamplingParams


class RequestError(ValueError):
    """Bad input in a request; `param` names the request field, `code` is OpenAI's error code (or None)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_prompt(
    prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int | None = None, param: str = "prompt"
) -> None:
    """A prompt must have a token, ids inside the vocabulary (when known) and room for one output token."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty", param)
    if vocab_size is not None and max(prompt_token_ids) >= vocab_size:
        raise RequestError(f"token id {max(prompt_token_ids)} is outside the vocabulary of {vocab_size}", param)
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {num_prompt} "
            f"tokens (max_model_len={max_model_len}; at least one output token must fit). Please shorten the prompt.",
            param,
            "context_length_exceeded",
        )


def check_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The HTTP API's rule (OpenAI's): asking for more tokens than the context has left is an error; the
    offline engine instead caps max_tokens at what is left (`make_core_request`)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or the completion length.",
            "max_tokens",
            "context_length_exceeded",
        )


def make_core_request(
    config: EngineConfig,
    request_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    arrival_time: float,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
    mm_inputs: tuple[MultiModalInput, ...] = (),
) -> EngineCoreRequest:
    """Check a request against the config (not against the queues) and build it; RequestError (a ValueError)
    says what is wrong."""
    check_prompt(prompt_token_ids, config.max_model_len)
    if lora_request is not None and not config.max_loras:
        raise RequestError("this engine serves no LoRA adapters (start it with enable_lora)", "model")
    num_prompt = len(prompt_token_ids)
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_token_ids),
        sampling_params=sampling_params,
        max_tokens=min(sampling_params.max_tokens, config.max_model_len - num_prompt),
        arrival_time=arrival_time,
        priority=priority,
        lora_request=lora_request,
        mm_inputs=tuple(mm_inputs),
    )
    try:
        check_images(config, request)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from exc
    return request
