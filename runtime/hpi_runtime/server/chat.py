"""POST /v1/chat/completions: messages rendered with the model's own chat template, OpenAI chat objects out."""

from __future__ import annotations

import time

from aiohttp import web
from jinja2 import TemplateError

from hpi_runtime.server.errors import bad_request
from hpi_runtime.server.generation import collect_choices, new_id, plan_choices, stream_choices
from hpi_runtime.server.logprobs import chat_logprobs
from hpi_runtime.server.protocol import ChatRequest, parse_chat
from hpi_runtime.server.request_io import check_model, read_json, tokenize_off_loop, usage
from hpi_runtime.server.sse import serve_stream
from hpi_runtime.server.state import STATE_KEY, ServerState


def render_prompt(tokenizer, body: ChatRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(
            list(body.messages), add_generation_prompt=True, tokenize=False, **body.chat_template_kwargs
        )
    except (TemplateError, TypeError, ValueError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    # The template already wrote BOS and the role markers.
    return tokenizer(text, add_special_tokens=False).input_ids


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = parse_chat(await read_json(request))
    model = state.admit()
    check_model(model, body.model)
    tokenizer = model.tokenizer
    num_chars = sum(len(str(message.get("content") or "")) for message in body.messages)
    prompt_ids = await tokenize_off_loop(lambda: render_prompt(tokenizer, body), num_chars)
    chat_id = new_id("chatcmpl")
    choices = plan_choices(chat_id, [prompt_ids], body.sampling, body.n, model, "messages")
    head = {"id": chat_id, "created": int(time.time()), "model": model.name}
    want_logprobs = body.sampling.logprobs is not None

    if not body.stream:
        finals = await collect_choices(model.engine, state.metrics, choices)
        completion_tokens = sum(len(out.output_token_ids) for _, out in finals)
        rendered = []
        for choice, out in finals:
            rendered.append({
                "index": choice.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(tokenizer, out.new_logprobs) if want_logprobs else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            })
        return web.json_response({**head, "object": "chat.completion", "choices": rendered,
                                  "usage": usage(len(prompt_ids), completion_tokens)})

    chunk_head = {**head, "object": "chat.completion.chunk"}
    counts = {"completion_tokens": 0}
    started: set[int] = set()

    async def render(choice, out) -> list[dict]:
        counts["completion_tokens"] += len(out.new_token_ids)
        payloads = []
        if choice.index not in started:
            started.add(choice.index)
            payloads.append({**chunk_head, "choices": [{"index": choice.index,
                             "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]})
        if out.text_delta or out.new_logprobs or out.finished:
            delta = {"content": out.text_delta} if out.text_delta else {}
            payloads.append({**chunk_head, "choices": [{
                "index": choice.index,
                "delta": delta,
                "logprobs": chat_logprobs(tokenizer, out.new_logprobs) if want_logprobs else None,
                "finish_reason": out.finish_reason if out.finished else None,
            }]})
        return payloads

    def trailer() -> list[dict]:
        if not body.include_usage:
            return []
        return [{**chunk_head, "choices": [], "usage": usage(len(prompt_ids), counts["completion_tokens"])}]

    return await serve_stream(request, stream_choices(model.engine, state.metrics, choices), render, trailer)
