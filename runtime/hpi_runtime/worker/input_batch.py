"""The persistent batch (vLLM v1's InputBatch): every running request's tokens, block table, progress and
sampling settings in preallocated host arrays, one row per request, updated from the scheduler's deltas.

A new request fills a free row, a finished or preempted one frees it, a cached one appends its new block
ids; a sampled token is written into its row. A step's draft tokens (speculative decoding) are written after
a row's known tokens without counting as known (`num_spec`): they are inputs of this step only, and the
tokens accepted from them are written over them. Each step's flat inputs (token ids, positions, KV slots,
block tables, query offsets) then come out of whole-array index arithmetic over the step's rows, with no
Python loop over tokens. The arrays grow (doubling) when a request or a sequence outgrows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from hpi_runtime.core.interface import NewRequestData, SchedulerOutput
from hpi_runtime.lora.slot_table import BASE_SLOT
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.sampler import SamplingBatch, mix_seed

_PENALTY_COLUMNS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", *_PENALTY_COLUMNS)


@dataclass(frozen=True)
class StepInputs:
    """One step's flat model inputs, on the host. Requests in batch order: decodes first, then chunks."""

    request_ids: tuple[str, ...]
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32 (columns past a request's blocks: stale ids)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    context_lens: torch.Tensor  # [num_reqs] int32: tokens in the cache after this step
    is_sampled: tuple[bool, ...]  # per request: its chunk reaches the end of its known tokens (and drafts)
    num_drafts: tuple[int, ...]  # per request: draft tokens at the end of its chunk (each position is sampled)
    num_decode_reqs: int
    max_query_len: int
    max_context_len: int
    # [num_tokens] int64: each token's LoRA slot (lora/slot_table.py); None: no token of the step uses an adapter
    token_lora_slots: np.ndarray | None = None


def _grown(array: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    """`array` copied into a zeroed array of at least (rows[, cols]), each at least doubled when it grows."""
    shape = [max(rows, 2 * array.shape[0]) if rows > array.shape[0] else array.shape[0]]
    if cols is not None:
        shape.append(max(cols, 2 * array.shape[1]) if cols > array.shape[1] else array.shape[1])
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown


class InputBatch:
    """Host-side state of the requests the runner holds (the runner is its only user)."""

    def __init__(self, block_size: int, eos_token_ids: frozenset[int], max_reqs: int = 64, max_len: int = 512):
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_reqs - 1, -1, -1))  # pop() hands out the lowest row first
        self.token_ids = np.zeros((max_reqs, max_len), dtype=np.int64)  # prompt + outputs so far
        self.num_tokens = np.zeros(max_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_reqs, dtype=np.int64)
        self.num_spec = np.zeros(max_reqs, dtype=np.int64)  # this step's draft tokens after num_tokens
        self.block_table = np.zeros((max_reqs, -(-max_len // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(max_reqs, dtype=np.int64)
        self.lora_slot = np.full(max_reqs, BASE_SLOT, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_reqs
        # Sampling settings as columns, so a step's batch is one gather per setting.
        self.float_columns = {name: np.zeros(max_reqs, dtype=np.float32) for name in _FLOAT_COLUMNS}
        self.top_k = np.zeros(max_reqs, dtype=np.int64)
        self.min_tokens = np.zeros(max_reqs, dtype=np.int64)
        self.uses_penalties = np.zeros(max_reqs, dtype=bool)
        self.uses_logit_bias = np.zeros(max_reqs, dtype=bool)
        self.prompt_logprob_ids: set[str] = set()  # requests that asked for prompt logprobs

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    def request_token_ids(self, request_id: str) -> list[int]:
        """Prompt + outputs so far of a request the batch holds."""
        row = self.row_of[request_id]
        return self.token_ids[row, : self.num_tokens[row]].tolist()

    def clear(self) -> None:
        for request_id in list(self.row_of):
            self.remove(request_id)

    # -- deltas -------------------------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.remove(request_id)
        for new in scheduler_output.new_requests:
            self.add(new)
        for cached in scheduler_output.cached_requests:
            row = self.row_of[cached.request_id]
            self._append_blocks(row, cached.new_block_ids)
            self.num_computed_tokens[row] = cached.num_computed_tokens
            if cached.new_token_ids:  # pipeline stages: the last stage's samples, sent back with the next step
                start = int(self.num_tokens[row])
                self._fit_tokens(start + len(cached.new_token_ids))
                self.token_ids[row, start : start + len(cached.new_token_ids)] = cached.new_token_ids
                self.num_tokens[row] = start + len(cached.new_token_ids)
        self.num_spec[:] = 0
        for request_id, draft_ids in scheduler_output.spec_token_ids.items():
            row = self.row_of[request_id]
            start = int(self.num_tokens[row])
            self._fit_tokens(start + len(draft_ids))
            self.token_ids[row, start : start + len(draft_ids)] = draft_ids
            self.num_spec[row] = len(draft_ids)

    def add(self, new: NewRequestData) -> None:
        self.remove(new.request_id)  # a request seen again (after a preemption) starts from scratch
        if not self.free_rows:
            self._grow(rows=2 * self.token_ids.shape[0])
        row = self.free_rows.pop()
        self.row_of[new.request_id] = row
        num_tokens = len(new.token_ids)
        self._fit_tokens(num_tokens)
        self.token_ids[row, :num_tokens] = new.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.block_table[row] = 0
        self._append_blocks(row, new.block_ids)
        self.lora_slot[row] = new.lora_slot
        params = new.sampling_params
        self.params[row] = params
        for name, column in self.float_columns.items():
            column[row] = getattr(params, name)
        self.top_k[row] = max(params.top_k, 0)
        self.min_tokens[row] = params.min_tokens
        self.uses_penalties[row] = bool(
            params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        )
        self.uses_logit_bias[row] = bool(params.logit_bias)
        if params.prompt_logprobs is not None:
            self.prompt_logprob_ids.add(new.request_id)

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        self.prompt_logprob_ids.discard(request_id)
        if row is not None:
            self.params[row] = None
            self.free_rows.append(row)

    def append_sampled(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """rows: [S] int64 -> one sampled token appended to each row."""
        self._fit_tokens(int(self.num_tokens[rows].max()) + 1)
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Several tokens appended to one row (a verification's accepted drafts and the token after them)."""
        start = int(self.num_tokens[row])
        self._fit_tokens(start + len(token_ids))
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)
        self.num_computed_tokens[row] = start + len(token_ids) - 1  # the rejected drafts' KV is stale

    def _append_blocks(self, row: int, block_ids: tuple[int, ...]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, self.block_table.shape[0], end)
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _fit_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, self.token_ids.shape[0], num_tokens)

    def _grow(self, rows: int) -> None:
        for name in ("token_ids", "block_table"):
            array = getattr(self, name)
            setattr(self, name, _grown(array, rows, array.shape[1]))
        for name in ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_spec", "num_blocks", "top_k",
                     "min_tokens", "uses_penalties", "uses_logit_bias", "lora_slot"):  # fmt: skip
            setattr(self, name, _grown(getattr(self, name), rows))
        self.float_columns = {name: _grown(column, rows) for name, column in self.float_columns.items()}
        old = len(self.params)
        self.params += [None] * (self.token_ids.shape[0] - old)
        self.free_rows = list(range(self.token_ids.shape[0] - 1, old - 1, -1)) + self.free_rows

    # -- one step -----------------------------------------------------------------------------------------

    def rows_of(self, request_ids: tuple[str, ...]) -> np.ndarray:  # [R] int64
        return np.fromiter((self.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))

    def prepare(self, num_scheduled_tokens: Mapping[str, int]) -> StepInputs:
        """The step's flat inputs; advances each scheduled request's num_computed_tokens past its chunk."""
        scheduled_ids = tuple(num_scheduled_tokens)
        query_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=len(scheduled_ids))
        # Decodes first (stable), so attention backends see two contiguous groups.
        order = np.argsort(query_lens != 1, kind="stable")
        request_ids = tuple(scheduled_ids[i] for i in order)
        query_lens = query_lens[order]
        rows = self.rows_of(request_ids)
        starts = self.num_computed_tokens[rows]
        ends = starts + query_lens
        num_known = self.num_tokens[rows] + self.num_spec[rows]  # drafts included: they are inputs too
        self._check(request_ids, rows, starts, ends, query_lens, num_known)
        flat = self.flat_inputs(rows, starts, query_lens)
        self.num_computed_tokens[rows] = ends
        lora_slots = self.lora_slot[rows]
        uses_lora = bool((lora_slots != BASE_SLOT).any())
        return StepInputs(
            request_ids=request_ids,
            **flat,
            is_sampled=tuple((ends == num_known).tolist()),
            num_drafts=tuple(self.num_spec[rows].tolist()),
            num_decode_reqs=int((query_lens == 1).sum()),
            max_query_len=int(query_lens.max()),
            max_context_len=int(ends.max()),
            token_lora_slots=np.repeat(lora_slots, query_lens) if uses_lora else None,
        )

    def flat_inputs(self, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray) -> dict[str, torch.Tensor]:
        """The flat tensors of a forward over tokens [starts, starts + query_lens) of `rows` (all [R] int64):
        StepInputs' input_ids, positions, slot_mapping, block_tables, query_start_loc and context_lens."""
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(len(rows)), query_lens)  # [T] -> index into rows
        positions = starts[req_of_token] + np.arange(num_tokens) - query_start_loc[req_of_token]
        token_rows = rows[req_of_token]
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        ends = starts + query_lens
        return {
            "input_ids": torch.from_numpy(self.token_ids[token_rows, positions]),
            "positions": torch.from_numpy(positions),
            "slot_mapping": torch.from_numpy(slot_mapping),
            "block_tables": torch.from_numpy(self.block_table[rows, : int(-(-ends.max() // bs))]),
            "query_start_loc": torch.from_numpy(query_start_loc.astype(np.int32)),
            "context_lens": torch.from_numpy(ends.astype(np.int32)),
        }

    def _check(
        self,
        request_ids: tuple[str, ...],
        rows: np.ndarray,  # [R] int64
        starts: np.ndarray,  # [R] int64: computed tokens before this step
        ends: np.ndarray,  # [R] int64: after it
        query_lens: np.ndarray,  # [R] int64
        num_known: np.ndarray,  # [R] int64: tokens (and drafts) the batch holds
    ) -> None:
        """Deltas that contradict what the batch holds (a scheduler bug), named by request."""
        beyond = np.flatnonzero(ends > num_known)
        if beyond.size:
            i = int(beyond[0])
            raise ValueError(f"request {request_ids[i]}: {query_lens[i]} tokens scheduled from {starts[i]}, "
                             f"but only {num_known[i]} are known")  # fmt: skip
        needed = -(-ends // self.block_size)
        short = np.flatnonzero(needed > self.num_blocks[rows])
        if short.size:
            i = int(short[0])
            raise ValueError(f"request {request_ids[i]} needs {needed[i]} blocks, has {self.num_blocks[rows[i]]}")

    def prompt_logprob_chunks(self, step: StepInputs) -> list[tuple[str, int, int, int, list[int], int]]:
        """For the step's requests that want prompt logprobs: (id, first row of its chunk, first position, rows
        that predict a prompt token, those tokens, top-n), as worker/prompt_logprobs.py takes them."""
        chunks = []
        query_start_loc = step.query_start_loc.tolist()
        for i, request_id in enumerate(step.request_ids):
            if request_id not in self.prompt_logprob_ids:
                continue
            row = self.row_of[request_id]
            end = int(step.context_lens[i])
            start = end - (query_start_loc[i + 1] - query_start_loc[i])
            stop = min(end, int(self.num_prompt_tokens[row]) - 1)  # the last prompt token predicts an output
            if stop > start:
                targets = self.token_ids[row, start + 1 : stop + 1].tolist()
                chunks.append((request_id, query_start_loc[i], start, stop - start, targets,
                               self.params[row].prompt_logprobs))
        return chunks

    def sampling_batch(
        self, rows: np.ndarray, device: torch.device, offsets: np.ndarray | None = None
    ) -> SamplingBatch:
        """Sampling settings of `rows` ([S] int64, a row repeated once per position it samples), in that order.

        `offsets` ([S] int64, default 0): the position sampled, counted from the row's next token; offset j
        samples as if the row's first j drafts were accepted (seeds, min_tokens and penalties see them)."""

        def column(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values[rows]).to(device)

        params = [self.params[row] for row in rows.tolist()]
        ends = self.num_tokens[rows] if offsets is None else self.num_tokens[rows] + offsets
        num_outputs = ends - self.num_prompt_tokens[rows]
        banned: tuple[tuple[int, ...], ...] = ()
        if bool((in_min_tokens := num_outputs < self.min_tokens[rows]).any()):
            banned = tuple(
                tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))) if active else ()
                for p, active in zip(params, in_min_tokens.tolist(), strict=True)
            )
        penalties = {}
        if bool(self.uses_penalties[rows].any()):
            penalties = {name: column(self.float_columns[name]) for name in _PENALTY_COLUMNS}
            penalties["prompt_token_ids"] = tuple(
                tuple(self.token_ids[row, : self.num_prompt_tokens[row]].tolist()) for row in rows.tolist()
            )
            penalties["output_token_ids"] = tuple(
                tuple(self.token_ids[row, self.num_prompt_tokens[row] : end].tolist())
                for row, end in zip(rows.tolist(), ends.tolist(), strict=True)
            )
        logit_bias = tuple(p.logit_bias for p in params) if bool(self.uses_logit_bias[rows].any()) else ()
        return SamplingBatch(
            temperature=column(self.float_columns["temperature"]),
            top_k=column(self.top_k),
            top_p=column(self.float_columns["top_p"]),
            min_p=column(self.float_columns["min_p"]),
            seeds=tuple(
                None if p.seed is None else mix_seed(p.seed, n)
                for p, n in zip(params, num_outputs.tolist(), strict=True)
            ),
            num_logprobs=tuple(p.logprobs for p in params),
            banned_token_ids=banned,
            logit_bias=logit_bias,
            **penalties,
        )
