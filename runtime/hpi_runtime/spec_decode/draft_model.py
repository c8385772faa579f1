"""Draft-model speculation, the worker's side: a small model sharing the target's tokenizer proposes each
speculating request's draft tokens, k autoregressive passes batched across requests, just before the target
verifies them in the same step.

The draft has its own paged KV cache (its own tensors, one per draft layer) addressed by the target's block
ids: every slot the target holds for a request has its twin in the draft's cache, so the scheduler's block
accounting (allocation, prefix sharing, preemption, the host tier) covers the draft with no second allocator
and no way to run out on its own. What the draft has computed of each request (`num_computed`) is its own:

- it catches up over the request's tokens it has not run yet (the whole prompt the first time, else the
  tokens accepted since), which gives the first draft; each further pass runs the newest draft, one token;
- after verification it keeps the KV of the drafts that were accepted (`settle`); the rest is overwritten;
- a request that is preempted, finished or sent again (after a swap or a recompute) starts over from 0, so KV
  left in a reused block, or in a prefix-cache hit the draft never computed for it, is never read as its own.

Greedy requests take the draft's argmax (a point mass: verification keeps exactly the target's greedy
tokens); sampled ones draw from the draft's softmax at the request's temperature and return those
probabilities q for rejection sampling (verify.rejection_sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.core.interface import SchedulerOutput
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.worker.input_batch import InputBatch
from hpi_runtime.worker.sampler import mix_seed

_DRAFT_SEED_SALT = 0x5DEECE66D  # a draft's seeded draws differ from the target's at the same position


@dataclass(frozen=True)
class DraftProposal:
    """The drafts just written into the batch: per sampled request, the q each draft was drawn from."""

    draft_probs: dict[str, torch.Tensor]  # request id -> [k, V] float32; absent for greedy requests


class DraftModel:
    """A draft model, its KV cache and its progress per request (owned by the model runner)."""

    def __init__(self, model: DecoderForCausalLM, backend: AttentionBackend, block_size: int, seed: int = 0):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed ^ _DRAFT_SEED_SALT)
        self.num_computed: dict[str, int] = {}  # tokens of each request whose KV the draft holds

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Forget requests that left, and those sent again from scratch (their blocks may be new)."""
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.num_computed.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.num_computed[new.request_id] = 0

    @torch.inference_mode()
    def propose(self, batch: InputBatch, request_ids: list[str]) -> DraftProposal:
        """Fill the draft slots of `request_ids` (batch.num_spec of them each, after their known tokens)."""
        rows = batch.rows_of(tuple(request_ids))
        num_known = batch.num_tokens[rows].copy()
        num_drafts = batch.num_spec[rows].copy()
        temperature = batch.float_columns["temperature"][rows]
        starts = np.fromiter((self.num_computed.get(r, 0) for r in request_ids), dtype=np.int64, count=len(rows))
        sampled = {i: [] for i in np.flatnonzero(temperature > 0).tolist()}  # request index -> its q rows
        active = np.arange(len(rows))
        for j in range(int(num_drafts.max())):
            active = active[num_drafts[active] > j]
            query_lens = num_known[active] - starts[active] if j == 0 else np.ones(len(active), dtype=np.int64)
            pass_starts = starts[active] if j == 0 else num_known[active] + j - 1
            logits = self._forward(batch, rows[active], pass_starts, query_lens)
            token_ids = self._draw(logits, active, temperature, sampled, batch, rows, num_known + j)
            batch.token_ids[rows[active], num_known[active] + j] = token_ids
        probs = {request_ids[i]: torch.stack(q) for i, q in sampled.items()}
        return DraftProposal(draft_probs=probs)

    def settle(self, request_id: str, num_known: int, num_drafts: int, num_accepted: int) -> None:
        """After verification: the draft holds KV up to its last accepted draft (it never ran the last draft)."""
        self.num_computed[request_id] = num_known + min(num_accepted, num_drafts - 1)

    def _forward(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray) -> torch.Tensor:
        """Run the draft over tokens [starts, starts + query_lens) of `rows` ([R] int64 each); logits of each
        row's last token, [R, V] float32, in the order given."""
        order = np.argsort(query_lens != 1, kind="stable")  # decodes first, as the backends expect
        flat = batch.flat_inputs(rows[order], starts[order], query_lens[order])
        ends = (starts + query_lens)[order]
        device = self.device
        metadata = self.backend.build_metadata(AttentionMetadata(
            slot_mapping=flat["slot_mapping"].to(device),
            block_tables=flat["block_tables"].to(device),
            query_start_loc=flat["query_start_loc"].to(device),
            context_lens=flat["context_lens"].to(device),
            num_decode_reqs=int((query_lens == 1).sum()),
            max_query_len=int(query_lens.max()),
            max_context_len=int(ends.max()),
            block_size=self.block_size,
        ))  # fmt: skip
        hidden = self.model(flat["input_ids"].to(device), flat["positions"].to(device), metadata)
        last = flat["query_start_loc"][1:].to(torch.int64) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last.to(device)))
        return logits[torch.from_numpy(np.argsort(order)).to(device)]

    def _draw(
        self,
        logits: torch.Tensor,  # [A, V] float32
        active: np.ndarray,  # [A] int64: indices into the proposal's requests
        temperature: np.ndarray,  # [R] float32
        sampled: dict[int, list[torch.Tensor]],
        batch: InputBatch,
        rows: np.ndarray,  # [R] int64
        positions: np.ndarray,  # [R] int64: where this pass's draft goes
    ) -> list[int]:
        token_ids = logits.argmax(dim=-1).tolist()
        for a, i in enumerate(active.tolist()):
            if i not in sampled:
                continue
            q = (logits[a] / float(temperature[i])).softmax(dim=-1)
            generator = self.generator
            seed = batch.params[int(rows[i])].seed
            if seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(mix_seed(seed ^ _DRAFT_SEED_SALT, int(positions[i])))
            token_ids[a] = int(torch.multinomial(q, 1, generator=generator))
            sampled[i].append(q)
        return token_ids
