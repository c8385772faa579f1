"""Render engine TokenLogprobs in the two OpenAI shapes (completions and chat)."""

from __future__ import annotations

from collections.abc import Sequence

from hpi_runtime.core.interface import TokenLogprobs


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, logprobs: Sequence[TokenLogprobs], text_offset: int = 0) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({token_text(tokenizer, t): v for t, v in lp.top} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, logprobs: Sequence[TokenLogprobs]) -> dict:
    content = []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        content.append(
            {
                "token": text,
                "logprob": lp.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := token_text(tokenizer, tid)), "logprob": v, "bytes": list(t.encode())}
                    for tid, v in lp.top
                ],
            }
        )
    return {"content": content}


def prompt_logprobs(tokenizer, logprobs: Sequence[TokenLogprobs] | None) -> list | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the token itself and its top-n alternatives."""
    if logprobs is None:
        return None
    rendered: list = [None]
    for lp in logprobs:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": token_text(tokenizer, lp.token_id)}}
        for rank, (token_id, value) in enumerate(lp.top, start=1):
            entry.setdefault(str(token_id), {"logprob": value, "rank": rank,
                                             "decoded_token": token_text(tokenizer, token_id)})
        rendered.append(entry)
    return rendered
