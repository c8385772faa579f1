"""Verifying draft tokens against the target model's own samples.

Each of a request's k + 1 verified positions is sampled from the target distribution as if the drafts before
it were accepted (same seed position, penalties, min_tokens), then the drafts are accepted while they equal
those samples, and the sample at the first mismatch (or after the last draft) is kept too. For a greedy
request that is exactly plain decoding. For a sampled one it is the rejection sampling of Leviathan et al. /
Chen et al. for a draft that puts all its mass on one token t: accept with probability p(t) (the chance that
the sample is t), and on rejection the sample is distributed as p without t, renormalised. So the output
keeps the target distribution, and a seeded request draws exactly the tokens it would without speculation.

A draft model's drafts of a sampled request come with the draft's own distribution q (not a point mass):
those are verified by `rejection_sample`. Greedy drafts are point masses and go through `num_accepted`.
"""

from __future__ import annotations

import torch


def num_accepted(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """Drafts accepted: the length of the common prefix of the drafts and the samples at their positions
    (sampled_token_ids has one more entry than draft_token_ids)."""
    for j, draft in enumerate(draft_token_ids):
        if sampled_token_ids[j] != draft:
            return j
    return len(draft_token_ids)


def rejection_sample(
    draft_token_ids: list[int],
    draft_probs: torch.Tensor,  # [k, V] float32: q, the distribution each draft was drawn from
    target_probs: torch.Tensor,  # [k + 1, V] float32: p at each draft position and the one after
    bonus_token_id: int,  # a draw from target_probs[k] (the sampler's own)
    generator: torch.Generator,
) -> list[int]:
    """Leviathan et al. / Chen et al. for a draft with its own distribution q: draft j is kept with probability
    min(1, p(t) / q(t)); at the first rejection the token is drawn from max(0, p - q) renormalised and the
    rest is dropped; all kept, the bonus token follows. The emitted tokens are distributed as p."""
    num_drafts = len(draft_token_ids)
    uniform = torch.rand(num_drafts, generator=generator, device=generator.device).tolist()
    index = torch.arange(num_drafts, device=draft_probs.device)
    ids = torch.tensor(draft_token_ids, device=draft_probs.device)
    p_of_draft = target_probs[index, ids].tolist()
    q_of_draft = draft_probs[index, ids].tolist()
    for j in range(num_drafts):
        if uniform[j] * q_of_draft[j] < p_of_draft[j]:
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere cannot reject; rounding can: draw from p
            residual = target_probs[j]
        recovered = int(torch.multinomial(residual, 1, generator=generator))
        return [*draft_token_ids[:j], recovered]
    return [*draft_token_ids, bonus_token_id]
