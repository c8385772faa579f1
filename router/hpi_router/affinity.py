"""Prefix affinity: a key from the start of a request's prompt, and a consistent-hash ring over backends.

The key is the first N characters of the prompt as the backend will see it (completions: the prompt;
chat: tools and messages rendered role by role), not tokens: the router has no tokenizer (and the fleet
may serve several), and characters are stable for the same text. N defaults to 256 characters, about 64
tokens or four 16-token KV blocks of English: long enough that two requests with the same key almost
surely share their first cached blocks, short enough to lie inside a typical system prompt, so that
requests which differ only after it still share the key. Requests with the same key prefer the same
backend (the ring), so the runtime's prefix cache hits across them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Iterator

VIRTUAL_NODES = 64  # ring points per backend: spreads keys evenly and moves only ~1/n of them on a change
MAX_TOKEN_IDS = 64  # a prompt given as token ids: this many ids make the key


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones are what the template renders
        # A malformed part (text not a string) is the backend's 400 to give; here it only adds nothing.
        return "".join(t for part in content if isinstance(part, dict) and isinstance(t := part.get("text"), str))
    return ""


def _prompt_text(body: dict) -> str | None:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            return None
        tools = json.dumps(body["tools"], sort_keys=True) if body.get("tools") else ""
        rendered = "".join(f"<{m.get('role')}>{_content_text(m.get('content'))}\x00"
                           for m in messages if isinstance(m, dict))
        return tools + rendered
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # token ids
            return ",".join(str(i) for i in prompt[:MAX_TOKEN_IDS])
        if isinstance(first, str):  # a batch: the first prompt decides
            return first
        if isinstance(first, list):  # a batch of token-id lists
            return ",".join(str(i) for i in first[:MAX_TOKEN_IDS])
        return None
    return prompt if isinstance(prompt, str) else None


def prefix_key(body: dict, num_chars: int) -> str | None:
    """The affinity key of a request body, or None (affinity off, or no usable prompt)."""
    if num_chars <= 0:
        return None
    text = _prompt_text(body)
    if not text:
        return None
    return f"{body.get('model')}\x00{text[:num_chars]}"


class HashRing:
    """Consistent hashing: `walk(key)` yields the backends in ring order from the key's point, each once."""

    def __init__(self, urls: Iterable[str]):
        points = sorted((_hash(f"{url}#{i}"), url) for url in set(urls) for i in range(VIRTUAL_NODES))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]
        self.num_backends = len(set(self._urls))

    def walk(self, key: str) -> Iterator[str]:
        """Lazily: a bisect (O(log n)), then a step per ring point. A caller that stops after k backends has
        stepped over about k points plus the repeats among them (few while k is much smaller than the fleet:
        each backend's points are spread over the ring), never over the whole ring."""
        if not self._urls:
            return
        start = bisect.bisect(self._hashes, _hash(key))
        seen: set[str] = set()
        for i in range(len(self._urls)):
            url = self._urls[(start + i) % len(self._urls)]
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == self.num_backends:
                    return

    def order(self, key: str) -> list[str]:
        """All backends in ring order from the key's point (the whole walk)."""
        return list(self.walk(key))
