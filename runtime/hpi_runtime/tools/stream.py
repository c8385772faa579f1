"""Streaming tool calls: pass text through as content until a tool call may have begun, then hold it.

The held text is parsed once the output is complete, and each call goes out as OpenAI streams them: a
`delta.tool_calls` entry with its index, id, type and name, then one with its arguments. Text that could be
the beginning of a marker (a trailing "<tool" while "<tool_call>" is the marker) is held until the next delta
says which it is, so `delta.content` never carries tool-call markup.
"""

from __future__ import annotations

from hpi_runtime.tools.parsers import ExtractedToolCalls, ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._held = ""
        self._in_calls = False
        self._decided_start = not parser.json_at_start  # whether the output opened with a JSON call

    def feed(self, text: str) -> str:
        """The content that can be sent now for this new text."""
        self._held += text
        if self._in_calls:
            return ""
        if not self._decided_start:
            stripped = self._held.lstrip()
            if not stripped:
                return ""
            self._decided_start = True
            if stripped.startswith("{"):
                self._in_calls = True
                return ""
        starts = [i for i in (self._held.find(m) for m in self.parser.start_markers) if i >= 0]
        if starts:
            self._in_calls = True
            content, self._held = self._held[: min(starts)], self._held[min(starts):]
            return content
        hold = max((k for m in self.parser.start_markers for k in range(1, len(m))
                    if self._held.endswith(m[:k])), default=0)  # fmt: skip
        content, self._held = self._held[: len(self._held) - hold], self._held[len(self._held) - hold:]
        return content

    def finish(self) -> ExtractedToolCalls:
        """The rest of the content and the calls, once the output is complete."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return ExtractedToolCalls(held or None, ())
        return self.parser.extract(held)
