"""Verifying draft tokens against the target model's own samples.

Each of a request's k + 1 verified positions is sampled from the target distribution as if the drafts before
it were accepted (same seed position, penalties, min_tokens), then the drafts are accepted while they equal
those samples, and the sample at the first mismatch (or after the last draft) is kept too. For a greedy
request that is exactly plain decoding. For a sampled one it is the rejection sampling of Leviathan et al. /
Chen et al. for a draft that puts all its mass on one token t: accept with probability p(t) (the chance that
the sample is t), and on rejection the sample is distributed as p without t, renormalised. So the output
keeps the target distribution, and a seeded request draws exactly the tokens it would without speculation.
"""

from __future__ import annotations


def num_accepted(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """Drafts accepted: the length of the common prefix of the drafts and the samples at their positions
    (sampled_token_ids has one more entry than draft_token_ids)."""
    for j, draft in enumerate(draft_token_ids):
        if sampled_token_ids[j] != draft:
            return j
    return len(draft_token_ids)
