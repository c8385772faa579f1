"""What a tenant's request used, read from the backend's answer as it passes through the router: the `usage` of a
JSON answer, or of a stream's final chunk. The router asks every tenant's stream for that chunk
(`stream_options.include_usage`, see `ask_for_usage`) and takes it out again when the client did not ask for it,
so the tokens-per-minute limit (limits.py) and the usage counters see every completed stream.

A stream cut short (the client went away, the backend died) has no final chunk, so its tokens are not counted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EVENT_END = b"\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a streamed request end with a usage chunk; True when the client did not ask for it (the router then
    strips it). Leaves a body it cannot read alone: the backend refuses it with a 400 anyway."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return False
    if options.get("include_usage") is True:
        return False
    body["stream_options"] = {**options, "include_usage": True}
    return True


def _usage(payload: Any) -> Usage | None:
    usage = payload.get("usage") if isinstance(payload, Mapping) else None
    if not isinstance(usage, Mapping):
        return None
    counts = [usage.get(name) for name in ("prompt_tokens", "completion_tokens")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None
    return Usage(*counts)


class UsageTap:
    """Feed it the answer's bytes in order; it returns what goes on to the client and keeps the last usage seen.
    A stream is passed on whole events at a time (an event split across two reads waits for its end)."""

    def __init__(self, streamed: bool, strip: bool, watch: bool = True):
        """`watch` False (no tenant to count for): every byte passes on at once, untouched."""
        self.streamed, self.strip, self.watch = streamed, strip, watch
        self.usage: Usage | None = None
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        if not self.watch:
            return data
        if not self.streamed:
            self._pending += data
            return data
        data = (self._pending + data).replace(b"\r\n", b"\n")  # SSE lines may end in CRLF: one framing here
        end = data.rfind(EVENT_END)
        if end < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: end + len(EVENT_END)], data[end + len(EVENT_END):]
        return b"".join(event + EVENT_END for event in complete.split(EVENT_END)[:-1] if self._keep(event))

    def finish(self) -> bytes:
        """The end of the answer: what is left to pass on (a JSON answer's usage is read here)."""
        left, self._pending = self._pending, b""
        if not self.watch:
            return b""
        if not self.streamed:
            try:
                self.usage = _usage(json.loads(left)) or self.usage
            except (ValueError, RecursionError):
                pass
            return b""
        return left

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event:
            return True
        data = b"".join(line[5:] for line in event.split(b"\n") if line.startswith(b"data:"))
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):
            return True
        usage = _usage(payload)
        if usage is None:
            return True
        self.usage = usage
        return not (self.strip and payload.get("choices") == [])  # the usage-only chunk the router asked for
