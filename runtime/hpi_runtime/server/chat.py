"""POST /v1/chat/completions: messages rendered with the model's own chat template, OpenAI chat objects out.

Image parts (a vision-language model) become the template's image placeholders; server/images.py reads the
images and expands each placeholder to the image's embedding tokens.

Tool calling (server/tool_calls.py) decides what the template renders and how the output is read back: as
`message.tool_calls`, or, streamed, as `delta.tool_calls` entries.
"""

from __future__ import annotations

import time

from aiohttp import web
from jinja2 import TemplateError

from hpi_runtime.server.errors import bad_request
from hpi_runtime.server.generation import (
    check_structured,
    collect_choices,
    new_id,
    plan_choices,
    stream_choices,
)
from hpi_runtime.server.images import read_images
from hpi_runtime.server.logprobs import chat_logprobs, prompt_logprobs
from hpi_runtime.server.protocol import ChatRequest, parse_chat
from hpi_runtime.server.request_io import check_model, read_json, tokenize_off_loop, usage
from hpi_runtime.server.sse import serve_stream
from hpi_runtime.server.state import STATE_KEY, ServerState
from hpi_runtime.server.tool_calls import ToolPlan, call_deltas, extract_calls, new_call_id, plan_tools, render_calls
from hpi_runtime.tools.stream import ToolCallStream


def render_prompt(tokenizer, body: ChatRequest, tools: tuple[dict, ...] = ()) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    kwargs = dict(body.chat_template_kwargs)
    if tools:
        kwargs["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(list(body.messages), add_generation_prompt=True, tokenize=False, **kwargs)
    except (TemplateError, TypeError, ValueError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    # The template already wrote BOS and the role markers.
    return tokenizer(text, add_special_tokens=False).input_ids


def _finish_reason(plan: ToolPlan, finish_reason: str | None, has_calls: bool) -> str | None:
    # OpenAI reports "tool_calls" when the model chose to call; a forced named function ends with "stop".
    if has_calls and finish_reason == "stop" and plan.mode != "named":
        return "tool_calls"
    return finish_reason


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = parse_chat(await read_json(request))
    model = state.admit()
    lora = check_model(model, body.model)
    plan, body = plan_tools(body, state.settings.tool_call_parser)
    await check_structured(body.sampling)
    tokenizer = model.tokenizer
    num_chars = sum(len(str(message.get("content") or "")) for message in body.messages)
    if body.image_urls and model.images is None:  # before the template, which may not know image parts
        await read_images(None, body.image_urls, [])
    prompt_ids = await tokenize_off_loop(lambda: render_prompt(tokenizer, body, plan.tools), num_chars)
    mm_inputs = ()
    if body.image_urls:
        prompt_ids, mm_inputs = await read_images(model.images, body.image_urls, prompt_ids)
    chat_id = new_id("chatcmpl")
    choices = plan_choices(chat_id, [prompt_ids], body.sampling, body.n, model, "messages", lora, mm_inputs)
    head = {"id": chat_id, "created": int(time.time()), "model": lora.lora_name if lora else model.name}
    want_logprobs = body.sampling.logprobs is not None

    if not body.stream:
        finals = await collect_choices(model.engine, state.metrics, choices)
        completion_tokens = sum(len(out.output_token_ids) for _, out in finals)
        rendered = []
        for choice, out in finals:
            message = {"role": "assistant", "content": out.text}
            finish_reason = out.finish_reason
            if plan.active and (extracted := extract_calls(plan, out.text)).calls:
                message = {"role": "assistant", "content": extracted.content,
                           "tool_calls": render_calls(plan, extracted.calls)}
                finish_reason = _finish_reason(plan, finish_reason, True)
            rendered.append({
                "index": choice.index,
                "message": message,
                "logprobs": chat_logprobs(tokenizer, out.new_logprobs) if want_logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": out.stop_reason,
            })
        return web.json_response({**head, "object": "chat.completion", "choices": rendered,
                                  "usage": usage(len(prompt_ids), completion_tokens),
                                  "prompt_logprobs": prompt_logprobs(tokenizer, finals[0][1].prompt_logprobs)})

    chunk_head = {**head, "object": "chat.completion.chunk"}
    counts = {"completion_tokens": 0}
    started: set[int] = set()
    streams = {c.index: _ChoiceStream(plan) for c in choices}

    async def render(choice, out) -> list[dict]:
        counts["completion_tokens"] += len(out.new_token_ids)
        payloads = []
        if choice.index not in started:
            started.add(choice.index)
            payloads.append({**chunk_head, "choices": [{"index": choice.index,
                             "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]})
        deltas, has_calls = streams[choice.index].deltas(out.text_delta, out.finished)
        if not deltas and (out.new_logprobs or out.finished):
            deltas = [{}]
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            payloads.append({**chunk_head, "choices": [{
                "index": choice.index,
                "delta": delta,
                "logprobs": chat_logprobs(tokenizer, out.new_logprobs) if want_logprobs and i == 0 else None,
                "finish_reason": _finish_reason(plan, out.finish_reason, has_calls) if out.finished and last else None,
            }]})
        return payloads

    def trailer() -> list[dict]:
        if not body.include_usage:
            return []
        return [{**chunk_head, "choices": [], "usage": usage(len(prompt_ids), counts["completion_tokens"])}]

    return await serve_stream(request, stream_choices(model.engine, state.metrics, choices), render, trailer)


class _ChoiceStream:
    """One choice's streamed deltas under its tool plan: content, or tool-call entries."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # required: held until complete
        self.call_id: str | None = None  # named: the call, opened by the first delta
        self.tool_stream = ToolCallStream(plan.parser) if plan.mode == "auto" else None
        self.has_calls = False

    def deltas(self, text: str, finished: bool) -> tuple[list[dict], bool]:
        plan = self.plan
        if plan.mode == "none":
            return ([{"content": text}] if text else []), False
        if plan.mode == "named":
            out = []
            if self.call_id is None and (text or finished):
                self.call_id = new_call_id(plan)
                self.has_calls = True
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": plan.named, "arguments": ""}}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out, self.has_calls
        out = []
        if plan.mode == "required":
            self.text += text
            if not finished:
                return [], False
            extracted = extract_calls(plan, self.text)
        else:
            content = self.tool_stream.feed(text)
            if content:
                out.append({"content": content})
            if not finished:
                return out, False
            extracted = self.tool_stream.finish()
        if extracted.content:  # text held back that turned out not to be a call
            out.append({"content": extracted.content})
        for entries in call_deltas(plan, extracted.calls, 0):
            out.append({"tool_calls": entries})
        self.has_calls = bool(extracted.calls)
        return out, self.has_calls
