"""POST /tokenize and /detokenize (vLLM's shapes) and GET /version."""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web
from jinja2 import TemplateError

from hpi_contracts.openai_requests import DETOKENIZE, TOKENIZE
from hpi_runtime import __version__
from hpi_runtime.server.errors import bad_request
from hpi_runtime.server.protocol import Body, parse_chat
from hpi_runtime.server.request_io import check_model, read_json, tokenize_off_loop
from hpi_runtime.server.state import STATE_KEY, ServerState


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": str, "add_special_tokens": bool} or {"messages": [...], "tools": [...]} (rendered with the chat
    template, as /v1/chat/completions would) -> {"count", "max_model_len", "tokens", "token_strs"}."""
    state: ServerState = request.app[STATE_KEY]
    fields = Body(await read_json(request), TOKENIZE)
    model = state.admit()
    tokenizer = model.tokenizer
    if fields.get("messages") is not None:
        body = parse_chat({**fields.body, "tool_choice": None})
        check_model(model, body.model)
        body = replace(body, chat_template_kwargs={**body.chat_template_kwargs,
                                                   "add_generation_prompt": fields.boolean("add_generation_prompt")})
        num_chars = sum(len(str(m.get("content") or "")) for m in body.messages)
        token_ids = await tokenize_off_loop(lambda: _render(tokenizer, body), num_chars)
    else:
        prompt = fields.string("prompt")
        if prompt is None:
            raise bad_request("send 'prompt' (a string) or 'messages'", "prompt")
        check_model(model, fields.string("model"))
        add_special = fields.boolean("add_special_tokens")
        token_ids = await tokenize_off_loop(lambda: tokenizer(prompt, add_special_tokens=add_special).input_ids,
                                            len(prompt))
    token_strs = tokenizer.convert_ids_to_tokens(token_ids) if fields.boolean("return_token_strs") else None
    return web.json_response({"count": len(token_ids), "max_model_len": model.max_model_len, "tokens": token_ids,
                              "token_strs": token_strs})


def _render(tokenizer, body) -> list[int]:
    kwargs = dict(body.chat_template_kwargs)
    add_generation_prompt = kwargs.pop("add_generation_prompt")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; send 'prompt'", "messages")
    try:
        text = tokenizer.apply_chat_template(list(body.messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False, tools=list(body.tools) or None, **kwargs)
    except (TemplateError, TypeError, ValueError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    return tokenizer(text, add_special_tokens=False).input_ids


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
    state: ServerState = request.app[STATE_KEY]
    fields = Body(await read_json(request), DETOKENIZE)
    model = state.admit()
    tokens = fields.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    check_model(model, fields.string("model"))
    if tokens and (min(tokens) < 0 or max(tokens) >= model.vocab_size):
        raise bad_request(f"token ids must be in [0, {model.vocab_size})", "tokens")
    return web.json_response({"prompt": model.tokenizer.decode(tokens)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})
