"""Prompt logprobs (vLLM's `prompt_logprobs`): the logprob of each prompt token given the ones before it.

The step computes logits only for the rows it samples; for a request that asked for prompt logprobs it also
computes them for the rows of its prefill chunk, and reports, per request, the logprobs of the prompt tokens
those rows predict (with their rank and the top-n alternatives). Only steps holding such a request pay
anything. Its prompt is never served from the prefix cache (the scheduler skips the lookup), since cached
tokens would not run through the model.
"""

from __future__ import annotations

import torch

from hpi_runtime.core.interface import TokenLogprobs


def compute_prompt_logprobs(
    compute_logits,  # [rows, hidden] -> [rows, V] fp32 logits (None on tensor-parallel ranks other than 0)
    hidden: torch.Tensor,  # [num_tokens, hidden_size]: the step's hidden states
    chunks: list[tuple[str, int, int, int, list[int], int]],
) -> dict[str, tuple[int, tuple[TokenLogprobs, ...]]]:
    """chunks: per request (id, first row in `hidden`, first position, number of rows, the prompt tokens those
    rows predict, top-n). Returns request id -> (index of the first prompt token covered, its logprobs)."""
    rows = torch.cat([torch.arange(first_row, first_row + n) for _, first_row, _, n, _, _ in chunks])
    logits = compute_logits(hidden.index_select(0, rows.to(hidden.device)))  # collective under TP: all ranks
    if logits is None:
        return {}
    logprobs = logits.log_softmax(dim=-1)
    targets = torch.tensor([t for *_, targets, _ in chunks for t in targets], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
    max_top = max(top for *_, top in chunks)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    results, offset = {}, 0
    for request_id, _, first_position, n, _, top in chunks:
        entries = []
        for i in range(offset, offset + n):
            alternatives = ()
            if top:
                alternatives = tuple(zip(top_ids[i, :top].tolist(), top_values[i, :top].tolist(), strict=True))
            entries.append(TokenLogprobs(int(targets[i]), float(chosen[i]), alternatives, int(ranks[i])))
        results[request_id] = (first_position + 1, tuple(entries))
        offset += n
    return results
