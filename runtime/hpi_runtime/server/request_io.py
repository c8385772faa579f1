"""Reading request bodies and the small checks every endpoint shares."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.server.errors import ApiError, bad_request
from hpi_runtime.server.state import STATE_KEY, ServedModel


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()  # raises 413 past the app's client_max_size
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app[STATE_KEY].settings.max_request_body_bytes
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large") from exc
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the C decoder recurses once per nesting level
        raise bad_request("the request body is nested too deeply to parse") from exc


T = TypeVar("T")
# Below this many characters tokenizing inline (well under a millisecond) costs less than a hop to a thread.
LONG_PROMPT_CHARS = 16_384


async def tokenize_off_loop(tokenize: Callable[[], T], num_chars: int) -> T:
    """Run `tokenize` (chat template + tokenizer) in a thread when the text is long, so a 100k-character prompt
    does not stall every other stream on the event loop."""
    if num_chars < LONG_PROMPT_CHARS:
        return tokenize()
    return await asyncio.to_thread(tokenize)


def check_model(model: ServedModel, requested: str | None) -> LoRARequest | None:
    """The LoRA adapter the request's 'model' names (None: the base model); a 404 naming what is served for
    any other name."""
    if requested is None or requested == model.name:
        return None
    lora = model.loras.get(requested) if model.loras is not None else None
    if lora is None:
        served = ", ".join(f"'{name}'" for name in [model.name, *(model.loras.names() if model.loras else ())])
        raise ApiError(
            404, f"The model '{requested}' does not exist; this server serves {served}.",
            param="model", code="model_not_found",
        )  # fmt: skip
    return lora


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

