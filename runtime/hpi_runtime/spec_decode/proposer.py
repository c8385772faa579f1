"""Draft tokens from the request's own tokens (prompt + output so far): no extra model.

Both methods find an earlier occurrence of the sequence's last tokens and propose what followed it:
- `ngram` (prompt lookup, vLLM's): the longest match of prompt_lookup_min..prompt_lookup_max tokens, then
  the k tokens after it;
- `suffix`: the longest match of any length (up to SUFFIX_MAX_MATCH), proposing at most as many tokens as
  the match is long (Arctic Inference's max_spec_factor 1): a long match is strong evidence, a short one is not.
Of the occurrences of the longest match, the most recent one that still has k tokens after it wins (in a
rewrite it is where the output last left the source passage); when none has, the earliest (the longest
continuation: in a repeating pattern the latest occurrence is the one just before the end).

With a draft model the tokens are the executor's to make (draft_model.py): the scheduler's proposer only
reserves the slots (`DraftModelSlots`), so the scheduler schedules, allocates and settles drafts the same way
whatever proposes them.
"""

from __future__ import annotations

import numpy as np

from hpi_runtime.spec_decode.params import SpeculativeParams

SUFFIX_MAX_MATCH = 64
DRAFT_SLOT = 0  # stands for a draft token the executor's draft model writes over it


def longest_match(tokens: np.ndarray, min_len: int, max_len: int, num_wanted: int) -> tuple[int, int]:
    """tokens: [L] int64 -> (end, n): tokens[end - n : end] == tokens[L - n :] with end < L, n the longest
    such length in [min_len, max_len], and end the latest of its occurrences followed by `num_wanted` tokens
    (else the earliest); (0, 0) when there is none."""
    length = tokens.shape[0]
    if length < min_len + 1:
        return 0, 0
    # Candidate ends: positions whose previous token equals the last one, growing the match backwards.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1
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
    with_room = best[best <= length - num_wanted]
    return int(with_room[-1] if with_room.size else best[0]), n


class Proposer:
    """Proposes draft tokens for one request from its tokens (a pure function of them)."""

    proposes_tokens = True  # real tokens, which a grammar can check before they are scheduled

    def __init__(self, params: SpeculativeParams) -> None:
        self.params = params
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
        if not n:
            return []
        if self.params.method == "suffix":
            max_tokens = min(max_tokens, n)
        return tokens[end : end + max_tokens].tolist()


class DraftModelSlots:
    """Draft-model speculation as the scheduler sees it: `max_tokens` slots, filled in by the executor."""

    proposes_tokens = False

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [DRAFT_SLOT] * max(0, max_tokens)


def make_proposer(params: SpeculativeParams) -> Proposer | DraftModelSlots:
    return DraftModelSlots() if params.method == "draft_model" else Proposer(params)
