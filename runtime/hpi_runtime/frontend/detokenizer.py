"""Incremental detokenization and stop-string matching for one request.

Text grows one token at a time (O(1) tokenizer work per token). Stop strings are searched only where a
new match can be (the new text plus the last len(stop)-1 characters before it). Text that could still
turn out to be the start of a stop string is held back, so a streamed delta never carries part of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpi_runtime.sampling_params import SamplingParams

_PREFILL_TOKENS = 6  # prompt context so the first output token decodes with the right leading space


class _OffsetDecodeStream:
    """Fallback for slow (Python) tokenizers: vLLM's prefix/read offsets over a short decode() window."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PREFILL_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence or a skipped token: wait for more
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return new_text[len(prefix_text) :]


def _make_decode_stream(tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return _OffsetDecodeStream(tokenizer, prompt_token_ids, skip_special_tokens).step
    from tokenizers.decoders import DecodeStream

    context = list(prompt_token_ids[-_PREFILL_TOKENS:])
    try:
        stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.23 cannot be primed with context
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    return lambda token_id: stream.step(backend, token_id)


class IncrementalDetokenizer:
    """Output text of one request, plus which part of it is safe to stream."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.text = ""
        self.num_emitted_chars = 0
        self._stops = params.stop
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._step = (
            None if tokenizer is None else _make_decode_stream(tokenizer, prompt_token_ids, params.skip_special_tokens)
        )

    def append(self, token_id: int, check_stops: bool = True) -> str | None:
        """Add one token's text. Returns the stop string if one now appears; text is cut before it."""
        if self._step is None:
            return None
        piece = self._step(token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += piece
        if not (self._stops and check_stops):
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def emit(self, finished: bool) -> str:
        """The text not streamed yet, minus a tail that could begin a stop string (unless finished)."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self.num_emitted_chars]

    def _held_back(self) -> int:
        text = self.text
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(len(stop) > k and stop.startswith(tail) for stop in self._stops):
                return k
        return 0
