"""POST /v1/completions: prompts (text or token ids) in, OpenAI text_completion objects out."""

from __future__ import annotations

import time

from aiohttp import web

from hpi_runtime.server.generation import (
    check_structured,
    collect_choices,
    new_id,
    plan_choices,
    stream_choices,
)
from hpi_runtime.server.logprobs import completion_logprobs, prompt_logprobs
from hpi_runtime.server.protocol import parse_completion
from hpi_runtime.server.request_io import check_model, read_json, tokenize_off_loop, usage
from hpi_runtime.server.sse import serve_stream
from hpi_runtime.server.state import STATE_KEY, ServerState


async def create_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = parse_completion(await read_json(request))
    model = state.admit()
    lora = check_model(model, body.model)
    await check_structured(body.sampling)
    tokenizer = model.tokenizer
    num_chars = sum(len(p) for p in body.prompts if isinstance(p, str))
    prompt_ids = await tokenize_off_loop(
        lambda: [list(p) if isinstance(p, tuple) else tokenizer(p).input_ids for p in body.prompts], num_chars
    )
    completion_id = new_id("cmpl")
    choices = plan_choices(completion_id, prompt_ids, body.sampling, body.n, model, "prompt", lora)
    echo = [tokenizer.decode(ids) if body.echo else "" for ids in prompt_ids]
    head = {"id": completion_id, "object": "text_completion", "created": int(time.time()),
            "model": lora.lora_name if lora else model.name}
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    want_logprobs = body.sampling.logprobs is not None

    if not body.stream:
        finals = await collect_choices(model.engine, state.metrics, choices)
        completion_tokens = sum(len(out.output_token_ids) for _, out in finals)
        rendered = []
        for choice, out in finals:
            prefix = echo[choice.prompt_index]
            logprobs = completion_logprobs(tokenizer, out.new_logprobs, len(prefix)) if want_logprobs else None
            rendered.append({"index": choice.index, "text": prefix + out.text, "logprobs": logprobs,
                             "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                             "prompt_logprobs": prompt_logprobs(tokenizer, out.prompt_logprobs)})
        return web.json_response({**head, "choices": rendered, "usage": usage(num_prompt_tokens, completion_tokens)})

    counts = {"completion_tokens": 0}
    offsets = {c.index: 0 for c in choices}
    started: set[int] = set()

    async def render(choice, out) -> list[dict]:
        counts["completion_tokens"] += len(out.new_token_ids)
        text = out.text_delta
        if choice.index not in started:
            started.add(choice.index)
            text = echo[choice.prompt_index] + text
        if not text and not out.finished and not out.new_logprobs:
            return []
        logprobs = None
        if want_logprobs:
            logprobs = completion_logprobs(tokenizer, out.new_logprobs, offsets[choice.index])
            offsets[choice.index] += sum(len(t) for t in logprobs["tokens"])
        finish = out.finish_reason if out.finished else None
        return [{**head, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish}]}]

    def trailer() -> list[dict]:
        if not body.include_usage:
            return []
        return [{**head, "choices": [], "usage": usage(num_prompt_tokens, counts["completion_tokens"])}]

    return await serve_stream(request, stream_choices(model.engine, state.metrics, choices), render, trailer)
