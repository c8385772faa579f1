"""Draft tokens from the request's own tokens (prompt + output so far): no extra model.

Both methods find an earlier occurrence of the sequence's last tokens and propose what followed it:
- `ngram` (prompt lookup, vLLM's): the longest match of prompt_lookup_min..prompt_lookup_max tokens, then
  the k tokens after it;
- `suffix`: the longest match of any length (up to SUFFIX_MAX_MATCH), proposing at most as many tokens as
  the match is long (Arctic Inference's max_spec_factor 1): a long match is strong evidence, a short one is not.
Of the occurrences of the longest match, the most recent one that still has k tokens after it wins (in a
rewrite it is where the output last left the source passage); when none has, the earliest (the longest
continuation: in a repeating pattern the latest occurrence is the one just before the end).

`suffix` with `suffix_decoding_max_cached_requests` > 0 (Arctic Inference's global cache, vLLM's key) also
searches the recent finished requests (`SuffixCache`: each one's last prompt tokens and its output) and takes
whichever match is longer, the request's own on a tie: a request that repeats an earlier one (a template, a
retried call, the same tool-call arguments) drafts its answer from the first decode step.

With a draft model the tokens are the executor's to make (draft_model.py): the scheduler's proposer only
reserves the slots (`DraftModelSlots`), so the scheduler schedules, allocates and settles drafts the same way
whatever proposes them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from hpi_runtime.spec_decode.params import SpeculativeParams

SUFFIX_MAX_MATCH = 64
_SEPARATOR = -1  # between the cached sequences: no token id
DRAFT_SLOT = 0  # stands for a draft token the executor's draft model writes over it


def longest_match(
    tokens: np.ndarray, min_len: int, max_len: int, num_wanted: int, limit: int | None = None
) -> tuple[int, int]:
    """tokens: [L] int64 -> (end, n): tokens[end - n : end] == tokens[L - n :] with end < L (end <= `limit`
    when given), n the longest such length in [min_len, max_len], and end the latest of its occurrences
    followed by `num_wanted` tokens (else the earliest); (0, 0) when there is none."""
    length = tokens.shape[0]
    if length < min_len + 1:
        return 0, 0
    # Candidate ends: positions whose previous token equals the last one, growing the match backwards.
    stop = length - 1 if limit is None else min(limit, length - 1)
    ends = np.flatnonzero(tokens[:stop] == tokens[length - 1]) + 1
    n, best = 1, ends
    while ends.size and n < max_len:
        ends = ends[ends > n]  # room for one more token before the match
        if not ends.size:
            break
        ends = ends[tokens[ends - n - 1] == tokens[length - n - 1]]
        if ends.size:
            n, best = n + 1, ends
        if n == length - 1:
            break
    if not best.size or n < min_len:
        return 0, 0
    with_room = best[best <= (length if limit is None else limit) - num_wanted]
    return int(with_room[-1] if with_room.size else best[0]), n


class SuffixCache:
    """The token sequences of the most recent finished requests (at most `max_requests`), searched as one
    array with a separator between sequences so that no match spans two of them."""

    def __init__(self, max_requests: int) -> None:
        self.sequences: deque[np.ndarray] = deque(maxlen=max_requests)
        self._joined: np.ndarray | None = None  # rebuilt at the next lookup after a change

    def add(self, token_ids: list[int]) -> None:
        self.sequences.append(np.asarray(token_ids, dtype=np.int64))
        self._joined = None

    def match(self, suffix: np.ndarray, num_wanted: int) -> tuple[np.ndarray, int]:
        """suffix: [S] int64 -> (the tokens after the longest match of suffix's end in the cache, its length
        n); (empty, 0) when none. The most recent occurrence with `num_wanted` tokens after it wins."""
        if not self.sequences:
            return suffix[:0], 0
        if self._joined is None:
            separator = np.array([_SEPARATOR], dtype=np.int64)
            self._joined = np.concatenate([part for seq in self.sequences for part in (seq, separator)])
        # Search the cache followed by the suffix: a match must end inside the cache (end <= len(cache)).
        tokens = np.concatenate((self._joined, np.array([_SEPARATOR], dtype=np.int64), suffix))
        end, n = longest_match(tokens, 1, min(SUFFIX_MAX_MATCH, len(suffix)), num_wanted,
                               limit=len(self._joined))  # fmt: skip
        if not n:
            return suffix[:0], 0
        continuation = self._joined[end : end + num_wanted]
        stop = np.flatnonzero(continuation == _SEPARATOR)
        return (continuation[: stop[0]] if stop.size else continuation), n


class Proposer:
    """Proposes draft tokens for one request from its tokens (a pure function of them and, for `suffix`
    with a cache, of the recent finished requests)."""

    proposes_tokens = True  # real tokens, which a grammar can check before they are scheduled

    def __init__(self, params: SpeculativeParams) -> None:
        self.params = params
        self.cache = SuffixCache(params.suffix_decoding_max_cached_requests) if (
            params.suffix_decoding_max_cached_requests) else None  # fmt: skip
        if params.method == "suffix":
            self.min_len, self.max_len = 1, SUFFIX_MAX_MATCH
        else:
            self.min_len, self.max_len = params.prompt_lookup_min, params.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` draft tokens to follow `token_ids`; [] when nothing earlier matches."""
        if max_tokens < 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        end, n = longest_match(tokens, self.min_len, self.max_len, max_tokens)
        proposal = tokens[end : end + max_tokens]
        if self.cache is not None:
            cached, n_cached = self.cache.match(tokens[-SUFFIX_MAX_MATCH:], max_tokens)
            if n_cached > n:
                proposal, n = cached, n_cached
        if not n:
            return []
        if self.params.method == "suffix":
            max_tokens = min(max_tokens, n)
        return proposal[:max_tokens].tolist()

    def request_finished(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Remember a finished request for later ones (with a cache): its last prompt tokens, then its output."""
        if self.cache is not None and output_token_ids:
            self.cache.add([*prompt_token_ids[-SUFFIX_MAX_MATCH:], *output_token_ids])


class DraftModelSlots:
    """Draft-model speculation as the scheduler sees it: `max_tokens` slots, filled in by the executor."""

    proposes_tokens = False

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [DRAFT_SLOT] * max(0, max_tokens)

    def request_finished(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Nothing to remember: the draft model's KV goes with the request."""


def make_proposer(params: SpeculativeParams) -> Proposer | DraftModelSlots:
    return DraftModelSlots() if params.method == "draft_model" else Proposer(params)
