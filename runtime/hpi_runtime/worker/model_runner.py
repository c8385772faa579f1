"""The model runner: scheduler deltas in, one batched forward over all scheduled tokens, sampled tokens out.

It keeps each request's token ids, block ids and progress from the `SchedulerOutput` deltas, packs the
step's tokens into flat tensors (decodes first, then prefill chunks), runs the model once for all of
them, computes logits only for the rows that are sampled, and samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpi_runtime.core.interface import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from hpi_runtime.model.attention import AttentionBackend, AttentionMetadata
from hpi_runtime.model.llama import LlamaForCausalLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.sampler import Sampler, SamplingBatch, mix_seed


@dataclass
class CachedRequestState:
    """The runner's copy of one request (mutable, owned by the runner)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True)
class StepLogits:
    """Logits of the rows sampled this step: row i belongs to request_ids[i]."""

    request_ids: tuple[str, ...]
    logits: torch.Tensor | None  # [num_sampled, vocab_size] float32; None on tensor-parallel ranks other than 0
    partial_request_ids: tuple[str, ...] = ()  # scheduled, but their prefill chunk did not reach the end


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    dtype: torch.dtype


def allocate_kv_caches(model: LlamaForCausalLM, spec: KVCacheSpec, device: torch.device) -> int:
    """Allocate and bind each layer's k/v cache (for the KV heads this rank holds); returns the bytes allocated."""
    total_bytes = 0
    for attn in model.attention_layers():
        shape = (spec.num_blocks, spec.block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        attn.v_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        total_bytes += 2 * attn.k_cache.numel() * attn.k_cache.element_size()
    return total_bytes


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        block_size: int,
        eos_token_ids: frozenset[int],
        seed: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.device = next(model.parameters()).device
        self.sampler = Sampler(seed, self.device)
        self.requests: dict[str, CachedRequestState] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.sample(self.forward(scheduler_output))

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def forward(self, scheduler_output: SchedulerOutput) -> StepLogits:
        """Run the model over every scheduled token; logits for the requests whose chunk ends their tokens."""
        self._update_states(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        # Decodes first (stable), so attention backends see two contiguous groups.
        request_ids = sorted(scheduled, key=lambda r: scheduled[r] != 1)
        if not request_ids:
            return StepLogits((), torch.empty(0, self.model.config.vocab_size, device=self.device))
        states = [self.requests[r] for r in request_ids]
        query_lens = [scheduled[r] for r in request_ids]
        starts = [s.num_computed_tokens for s in states]
        input_ids: list[int] = []
        for state, start, n in zip(states, starts, query_lens, strict=True):
            if start + n > len(state.token_ids):
                raise ValueError(
                    f"request {state.request_id}: {n} tokens scheduled from {start}, "
                    f"but only {len(state.token_ids)} are known"
                )
            input_ids.extend(state.token_ids[start : start + n])
            state.num_computed_tokens = start + n
        is_sampled = [start + n == len(s.token_ids) for s, start, n in zip(states, starts, query_lens, strict=True)]
        positions, metadata = self._prepare_inputs(states, starts, query_lens)
        hidden = self.model(torch.tensor(input_ids, device=self.device), positions, metadata)
        last_rows = metadata.query_start_loc[1:].long() - 1
        sampled_rows = last_rows[torch.tensor(is_sampled, device=self.device)]
        logits = self.model.compute_logits(hidden.index_select(0, sampled_rows))
        return StepLogits(
            request_ids=tuple(r for r, s in zip(request_ids, is_sampled, strict=True) if s),
            logits=logits,
            partial_request_ids=tuple(r for r, s in zip(request_ids, is_sampled, strict=True) if not s),
        )

    def _prepare_inputs(
        self, states: list[CachedRequestState], starts: list[int], query_lens: list[int]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Token positions [num_tokens] and the step's attention metadata (built on the host, then moved)."""
        device, bs = self.device, self.block_size
        context_lens = [start + n for start, n in zip(starts, query_lens, strict=True)]
        max_blocks = max(-(-c // bs) for c in context_lens)
        block_tables = torch.zeros(len(states), max_blocks, dtype=torch.int32)
        for row, (state, context_len) in enumerate(zip(states, context_lens, strict=True)):
            num_blocks = -(-context_len // bs)
            if len(state.block_ids) < num_blocks:
                raise ValueError(f"request {state.request_id} needs {num_blocks} blocks, has {len(state.block_ids)}")
            block_tables[row, :num_blocks] = torch.tensor(state.block_ids[:num_blocks], dtype=torch.int32)
        query_start_loc = torch.zeros(len(states) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
        # Slot of each new token: its position's block from the request's table, plus the offset in it.
        req_of_token = torch.repeat_interleave(torch.arange(len(states)), torch.tensor(query_lens))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)])
        slot_mapping = block_tables[req_of_token, positions // bs].long() * bs + positions % bs
        common = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            query_start_loc=query_start_loc.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            num_decode_reqs=sum(1 for n in query_lens if n == 1),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
        )
        return positions.to(device), self.backend.build_metadata(common)

    def _sampling_batch(self, states: Sequence[CachedRequestState]) -> SamplingBatch:
        params = [s.sampling_params for s in states]

        def column(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=self.device)

        uses_penalties = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
        banned = tuple(
            tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)))
            if len(s.output_token_ids) < p.min_tokens
            else ()
            for s, p in zip(states, params, strict=True)
        )
        penalties = {}
        if uses_penalties:
            penalties = dict(
                presence_penalty=column("presence_penalty"),
                frequency_penalty=column("frequency_penalty"),
                repetition_penalty=column("repetition_penalty"),
                prompt_token_ids=tuple(tuple(s.token_ids[: s.num_prompt_tokens]) for s in states),
                output_token_ids=tuple(tuple(s.output_token_ids) for s in states),
            )
        return SamplingBatch(
            temperature=column("temperature"),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=self.device),
            top_p=column("top_p"),
            min_p=column("min_p"),
            seeds=tuple(
                None if p.seed is None else mix_seed(p.seed, len(s.output_token_ids))
                for s, p in zip(states, params, strict=True)
            ),
            num_logprobs=tuple(p.logprobs for p in params),
            banned_token_ids=banned if any(banned) else (),
            **penalties,
        )

    @torch.inference_mode()
    def sample(self, step: StepLogits) -> ModelRunnerOutput:
        """Sample one token per row of `step`, append it to the request's tokens, report it.

        Under tensor parallelism rank 0 (which holds the gathered logits) samples and broadcasts the token
        ids, so every rank's copy of the requests stays identical whatever the sampler does."""
        sampled: dict[str, tuple[int, ...]] = dict.fromkeys(step.partial_request_ids, ())
        if not step.request_ids:
            return ModelRunnerOutput(sampled_token_ids=sampled)
        states = [self.requests[r] for r in step.request_ids]
        tp = self.model.tp
        if tp.size == 1:
            result = self.sampler(step.logits, self._sampling_batch(states))
            token_ids, token_logprobs = result.token_ids, result.logprobs
        else:
            token_ids, token_logprobs = self._sample_on_first_rank(step, states)
        logprobs = {}
        for state, token_id, lp in zip(states, token_ids, token_logprobs, strict=True):
            state.token_ids.append(token_id)
            if lp is not None:
                logprobs[state.request_id] = (lp,)
        sampled.update((s.request_id, (t,)) for s, t in zip(states, token_ids, strict=True))
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_on_first_rank(
        self, step: StepLogits, states: list[CachedRequestState]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        tokens = torch.full((len(states),), -1, dtype=torch.int64, device=self.device)
        token_logprobs: list[TokenLogprobs | None] = [None] * len(states)
        try:
            if self.model.tp.is_first:
                result = self.sampler(step.logits, self._sampling_batch(states))
                tokens.copy_(torch.tensor(result.token_ids, dtype=torch.int64))
                token_logprobs = list(result.logprobs)
        finally:  # the other ranks wait in this broadcast even when rank 0's sampler failed
            self.model.tp.broadcast_from_first(tokens)
        token_ids = tokens.tolist()
        if min(token_ids) < 0:
            raise RuntimeError("tensor-parallel rank 0 failed to sample this step")
        return token_ids, token_logprobs
