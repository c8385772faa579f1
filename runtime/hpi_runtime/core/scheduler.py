"""Continuous batching with one rule: each step, every request's computed tokens catch up to its tokens.

Running requests go first, in admission order, then waiting ones, under the per-step token budget
(`max_num_batched_tokens`) and `max_num_seqs`. That single rule covers chunked prefill (a prompt longer than
the budget catches up over several steps), decode (one token behind) and prefix-cache hits (admitted with
some tokens already computed). When the pool runs out of blocks the newest running request is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue; with a host KV tier
(`num_host_blocks`) its computed KV is first swapped out there, when there is room, and loaded back when it
is admitted again, so nothing is recomputed. To keep preemption rare, a
waiting request is admitted only if its whole prompt fits with `kv_admission_watermark` of the pool left free
for the running requests' decode growth; a request admitted into an empty batch needs only to fit, so a
prompt larger than the headroom is never starved.

The waiting queue holds the preempted requests first (each one requeued at the very front), then the others by
(priority, arrival): FCFS when every priority is the default 0. Priority orders admission only: a running
request is never preempted for a higher-priority waiting one, and the victim is still the newest running.

Requests under a grammar (structured outputs) that are sampled this step get a row of the step's token bitmask,
filled from their matcher here and applied by the sampler; `update_from_output` advances the matcher with
each accepted token (Request.append_token). A request that asked for prompt logprobs is never served from the
prefix cache: every prompt token has to run through the model.

With speculative decoding (`config.speculative`), each decode first gets draft tokens from the proposer
(spec_decode/proposer.py; with a draft model, slots that the executor's draft model fills), unless the policy
(spec_decode/policy.py) says this step would not gain from them.
The drafts are scheduled as extra query positions of the same request (one step of 1 + k tokens, blocks
allocated for all of them), and the executor returns the tokens it accepted plus one. `update_from_output`
then takes num_computed_tokens back over the rejected positions, whose KV the next step overwrites; the
prefix-cache hashes only ever cover token_ids, so never a draft. A request under a grammar has its drafts
cut at the first token the grammar forbids and one bitmask row per verified position (the target samples each
under the grammar as it would stand after the drafts before it); with a draft model (whose tokens are made in
the executor) it does not speculate.

With LoRA (`config.max_loras`), a batch runs at most max_loras distinct adapters (lora/slot_table.py pins each
running request's adapter in a device slot). A waiting request whose adapter would exceed that is passed over,
and the requests behind it may still be admitted when their adapter is already running (or they use the base
model). Most often a running adapter's requests all end soon and free its slot. If none has by the time the
first passed-over request has waited twice as many steps as the soonest-ending adapter's requests still need (at
most LORA_DRAIN_MAX_WAIT_STEPS), that adapter is drained: it takes no new request until the passed-over one is
admitted, so its slot frees in finite time and nobody starves. Draining at once, the rule before, kept the batch
smaller and the waits longer (bench/results/lora.md, run 15): the drained adapter's own new requests wait too. A
request whose adapter is neither in a slot nor read into host memory waits too, while its adapter is read in
the background (lora/slot_table.py, prefetch), unless nothing runs: a read from disk never holds up a batch.

With images (`config.encoder_cache_size`), a chunk that meets an image's placeholder run needs the image's
vision-encoder embeddings: computed this step (the whole image, at most `max_num_encoder_input_tokens` rows per
step) or found in the encoder cache (core/encoder_cache_manager.py). An image that fits neither this step's
encoder budget nor the cache's free room cuts the chunk short just before its placeholders; a chunk may end
inside a placeholder run, since the embeddings stay cached until the request has computed past it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.block_pool import KVBlock
from hpi_runtime.core.encoder_cache_manager import EncoderCacheManager
from hpi_runtime.core.engine_io import EngineCoreOutput
from hpi_runtime.core.interface import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from hpi_runtime.core.kv_cache_manager import KVCacheManager
from hpi_runtime.core.request import Request, RequestStatus
from hpi_runtime.lora.slot_table import LoRASlotTable
from hpi_runtime.spec_decode.policy import SpeculationPolicy, next_num_draft_tokens
from hpi_runtime.spec_decode.proposer import make_proposer
from hpi_runtime.structured.compiler import grammar_bitmask

# A request kept waiting for an adapter slot: one running adapter drains once it has waited this many times the
# steps that adapter's requests still need, or LORA_DRAIN_MAX_WAIT_STEPS (whichever is fewer).
LORA_DRAIN_PATIENCE = 2
LORA_DRAIN_MAX_WAIT_STEPS = 256


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        batches_in_flight: int | None = None,
    ) -> None:
        self.config = config
        # Batches the executor runs at once (pipeline stages: at least one per stage); each takes its share of the
        # requests. None: one per pipeline stage.
        self.batches_in_flight = batches_in_flight or config.pipeline_parallel_size
        self.kv = kv_cache_manager
        self.clock = clock
        self.requests: dict[str, Request] = {}  # unfinished ones
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_watermark_blocks = int(config.kv_admission_watermark * kv_cache_manager.num_blocks)
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0  # of those, resumed from the host tier instead of recomputed
        self.num_prefill_tokens_computed = 0  # tokens run through the model to build KV of known tokens
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Requests whose state the executor holds -> how many of their tokens it knows (pipeline stages learn
        # sampled tokens only through CachedRequestData.new_token_ids).
        self._in_executor: dict[str, int] = {}
        self._finished_ids: set[str] = set()  # executor must drop these (sent with the next batch)
        self._preempted_ids: set[str] = set()
        # The batches in flight, oldest first, until update_from_output: one, or with pipeline stages up to one per
        # stage (EngineCore's batch queue). A request in one is not scheduled again until its step returns.
        self._scheduled: deque[dict[str, Request]] = deque()
        spec = config.speculative
        self.proposer = make_proposer(spec) if spec is not None else None
        self.spec_policy = SpeculationPolicy(spec.disable_by_batch_size) if spec is not None else None
        self.lora = LoRASlotTable(config.max_loras, config.max_cpu_loras) if config.max_loras else None
        self._draining_lora: int | None = None  # the running adapter that admits nothing while one waits
        self._lora_blocked: tuple[str, int] | None = None  # the first request kept waiting for a slot, since when
        self._num_schedules = 0
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size) if config.encoder_cache_size else None
        self._encoder_budget = 0  # embedding rows the vision encoder may still compute this step
        self._encoder_inputs: dict[str, tuple[int, ...]] = {}  # this step's: request id -> image indices to encode
        self._encoding: set[str] = set()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        # Behind every preempted request and every request of the same or a higher priority (a lower value);
        # scanning from the back makes the usual all-default case an append.
        waiting, priority = self.waiting, request.priority
        i = len(waiting)
        while i and waiting[i - 1].priority > priority and waiting[i - 1].status == RequestStatus.WAITING:
            i -= 1
        waiting.insert(i, request)

    def schedule(self) -> SchedulerOutput:
        self._num_schedules += 1
        self.kv.begin_step()
        self._encoder_budget, self._encoder_inputs = self.config.max_num_encoder_input_tokens, {}
        self._encoding = set()  # hashes of the images the executor encodes this step
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, list[KVBlock]]] = []  # batch order
        running, kv = self.running, self.kv
        preempted = False
        if self.proposer is not None:
            self._propose_drafts()
        # Pipeline stages: each batch in flight takes its share of the unfinished requests, so the next batch finds
        # some not in flight and every stage has work (one batch of everything would leave the others idle).
        num_batches = self.batches_in_flight
        max_batch_reqs = -(-len(self.requests) // num_batches) if num_batches > 1 else len(self.requests)
        i = 0
        while i < len(running) and budget > 0 and len(scheduled) < max_batch_reqs:
            request = running[i]
            if request.num_computed_tokens == request.num_tokens:  # in flight, its sampled token not back yet
                i += 1
                continue
            num_new, new_blocks = self._allocate_running(request, budget)
            if num_new == 0:  # its next chunk starts at an image the encoder cannot take this step
                i += 1
                continue
            while new_blocks is None:
                victim = self._pop_victim(i)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            if request.mm_inputs:
                self._commit_encoder(request, request.num_computed_tokens, num_new)
            scheduled.append((request, num_new, new_blocks))
            budget -= num_new
            i += 1
        # After a preemption the pool is known to be short; admitting now would just thrash.
        position, passed_over = 0, False  # position: of the next candidate in `waiting`
        if self.lora is not None:
            self._prefetch_waiting_adapters()
        while (not preempted and position < len(self.waiting) and budget > 0 and len(running) < self.config.max_num_seqs
               and len(scheduled) < max_batch_reqs):
            request = self.waiting[position]
            if self.lora is not None and request.lora_request is not None:
                fits = self._lora_fits(request, passed_over)
                if not fits or (running and not self.lora.ready(request.lora_request)):
                    # Kept waiting: for a slot, or for its adapter's read in the background.
                    passed_over = passed_over or not fits
                    position += 1
                    continue
            # Prompt logprobs need every prompt token to run through the model: no prefix-cache hit.
            computed = kv.get_computed_blocks(request, request.sampling_params.prompt_logprobs is None)
            num_hit_tokens = computed.num_tokens
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if request.mm_inputs and (num_new := self._encoder_limit(request, num_hit_tokens, num_new)) == 0:
                break
            if running and kv.num_free_blocks_after_admission(request, computed) < self.num_watermark_blocks:
                break
            if kv.allocate_slots(request, num_new, computed) is None:
                break
            del self.waiting[position]
            if request.mm_inputs:
                self._commit_encoder(request, num_hit_tokens, num_new)
            self._admit(request, num_hit_tokens)
            scheduled.append((request, num_new, []))
            budget -= num_new
        if not passed_over:
            self._draining_lora, self._lora_blocked = None, None
        return self._make_output(scheduled)

    def _pop_victim(self, first: int) -> Request:
        """Take the newest running request at or after index `first` (before it: already scheduled this step)
        that no batch in flight holds: a request preempted mid-flight would be sampled twice once readmitted."""
        in_flight = set().union(*self._scheduled) if self._scheduled else set()
        j = len(self.running) - 1
        while j > first and self.running[j].request_id in in_flight:
            j -= 1
        return self.running.pop(j)

    def _lora_fits(self, request: Request, passed_over: bool) -> bool:
        """Whether the adapter limit lets `request` in now (`passed_over`: one before it in the queue waits)."""
        lora = request.lora_request
        if not self.lora.can_admit(lora):
            if not passed_over and self._draining_lora not in self.lora.users:
                self._draining_lora = self._drain_for(request)  # the first one kept waiting: free a slot for it
            return False
        return not (passed_over and lora is not None and lora.lora_int_id == self._draining_lora)

    def _drain_for(self, request: Request) -> int | None:
        """The running adapter to drain for `request`, the first one kept waiting for a slot: the one whose running
        requests end soonest (the most tokens any of them may still generate; ties: fewer requests, then id),
        once `request` has waited LORA_DRAIN_PATIENCE times as many steps as that (None until then). Its slot
        frees after the fewest steps, and until then its clients' new requests wait with the waiting adapter's,
        so a shorter drain keeps the batch fuller (the fewest requests, the rule before, may drain one long
        request for hundreds of steps while a nearly finished adapter would have freed its slot in a few)."""
        if self._lora_blocked is None or self._lora_blocked[0] != request.request_id:
            self._lora_blocked = (request.request_id, self._num_schedules)
        steps_left: dict[int, int] = {}
        for running in self.running:
            if running.lora_request is not None:
                lora_id = running.lora_request.lora_int_id
                left = running.max_tokens - len(running.output_token_ids)
                steps_left[lora_id] = max(steps_left.get(lora_id, 0), left)
        victim = min(self.lora.users, key=lambda i: (steps_left.get(i, 0), self.lora.users[i], i))
        waited = self._num_schedules - self._lora_blocked[1]
        patience = min(LORA_DRAIN_PATIENCE * steps_left.get(victim, 0), LORA_DRAIN_MAX_WAIT_STEPS)
        return victim if waited >= patience else None

    def _prefetch_waiting_adapters(self) -> None:
        """Have host memory read the adapters the waiting requests need and lacks, in queue order, as soon as
        they wait: a read never undoes one that a request ahead waits for, and at most max_cpu_loras are kept."""
        wanted: set[int] = set()
        for request in self.waiting:
            lora = request.lora_request
            if lora is None or lora.lora_int_id in wanted:
                continue
            if not self.lora.ready(lora):
                self.lora.prefetch(lora, wanted)
            wanted.add(lora.lora_int_id)
            if len(wanted) == self.lora.num_cpu:
                break

    def lora_stats(self) -> dict:
        """EngineStats' LoRA fields (none without LoRA)."""
        if self.lora is None:
            return {}
        waiting = {r.lora_request.lora_name for r in self.waiting if r.lora_request is not None}
        return {"lora_running": self.lora.active_names(), "lora_waiting": tuple(sorted(waiting)),
                "lora_slot_loads": self.lora.num_slot_loads, "lora_host_evictions": self.lora.num_host_evictions}

    def _allocate_running(self, request: Request, budget: int) -> tuple[int, list[KVBlock] | None]:
        """Blocks for a running request's next tokens (and drafts) within `budget`: (tokens, new blocks), the
        blocks None when the pool is short even without the drafts."""
        drafts = request.spec_token_ids
        num_new = min(len(request.token_ids) - request.num_computed_tokens + len(drafts), budget)
        if drafts:  # the budget may cut the drafts short
            del drafts[max(0, num_new - 1) :]
        if request.mm_inputs and (num_new := self._encoder_limit(request, request.num_computed_tokens, num_new)) == 0:
            return 0, []
        new_blocks = self.kv.allocate_slots(request, num_new)
        if new_blocks is None and drafts:  # drafts never cost anyone a preemption
            num_new -= len(drafts)
            request.spec_token_ids = []
            new_blocks = self.kv.allocate_slots(request, num_new)
        return num_new, new_blocks

    def _encoder_limit(self, request: Request, start: int, num_new: int) -> int:
        """How many of tokens [start, start + num_new) can run this step: up to the first image whose embeddings
        are neither cached nor computable now (this step's encoder budget, the cache's room)."""
        cache, end = self.encoder_cache, start + num_new
        num_rows, planned = 0, set()
        # Cached entries this request will use are pinned before anything is evicted for its new ones.
        pinned = {mm.mm_hash for mm in request.mm_inputs if mm.overlaps(start, end) and mm.mm_hash in cache.freeable}
        num_pinned = sum(cache.sizes[mm_hash] for mm_hash in pinned)
        for mm in request.mm_inputs:
            if mm.offset >= end:
                break
            if mm.end <= start or mm.mm_hash in cache.users or mm.mm_hash in planned:
                continue
            num_rows += mm.length
            if num_rows > self._encoder_budget or num_rows > cache.num_free + cache.num_freeable - num_pinned:
                return max(0, mm.offset - start)
            planned.add(mm.mm_hash)
        return num_new

    def _commit_encoder(self, request: Request, start: int, num_new: int) -> None:
        """Reference the cached embeddings of the images tokens [start, start + num_new) meet, and room for the
        others, which the executor computes this step (`_encoder_limit` said they fit)."""
        cache, end, request_id = self.encoder_cache, start + num_new, request.request_id
        to_encode = []
        for mm in request.mm_inputs:
            if mm.overlaps(start, end):
                cache.use_cached(request_id, mm)
        for i, mm in enumerate(request.mm_inputs):
            if mm.overlaps(start, end) and mm.mm_hash not in cache.users:
                cache.allocate(request_id, mm)
                self._encoding.add(mm.mm_hash)
                self._encoder_budget -= mm.length
                to_encode.append(i)
        if to_encode:
            self._encoder_inputs[request_id] = tuple(to_encode)

    def _release_images(self, request: Request, computed_only: bool) -> None:
        """Drop the request's references to image embeddings it no longer needs (`computed_only`: those whose
        placeholders it has computed; else all)."""
        for mm in request.mm_inputs:
            if not computed_only or mm.end <= request.num_computed_tokens:
                self.encoder_cache.release(request.request_id, mm)

    def _propose_drafts(self) -> None:
        """Draft tokens for each running decode outside a grammar, or none when the step would not gain."""
        decodes = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        maximum = self.config.speculative.num_speculative_tokens
        num_draft_tokens = 0
        for request in self.running:
            request.spec_token_ids = []
        for request in decodes:
            if request.grammar is not None and not self.proposer.proposes_tokens:
                continue  # a draft model's tokens are made in the executor, past the grammar's reach
            request.num_draft_tokens = request.num_draft_tokens or maximum
            # Never past max_tokens: a step emits at most drafts + 1 tokens (this also keeps max_model_len).
            limit = min(request.num_draft_tokens, request.max_tokens - len(request.output_token_ids) - 1)
            request.spec_token_ids = self.proposer.propose(request.token_ids, limit)
            if request.grammar is not None:  # no draft past the first one the grammar forbids
                del request.spec_token_ids[request.grammar.num_allowed(request.spec_token_ids) :]
            num_draft_tokens += len(request.spec_token_ids)
        if num_draft_tokens and not self.spec_policy.should_speculate(len(decodes), num_draft_tokens):
            for request in decodes:
                request.spec_token_ids = []

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
            request.num_cached_prompt_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        if self.lora is not None:
            request.lora_slot = self.lora.acquire(request.lora_request)
        self.running.append(request)

    def _make_output(self, scheduled: list[tuple[Request, int, list[KVBlock]]]) -> SchedulerOutput:
        new_requests, cached_requests, num_scheduled, spec_token_ids = [], [], {}, {}
        constrained: list[Request] = []
        for request, num_new, new_blocks in scheduled:
            request_id = request.request_id
            if request_id in self._in_executor:
                block_ids = tuple([block.block_id for block in new_blocks]) if new_blocks else ()
                new_token_ids = ()
                if self.config.pipeline_parallel_size > 1:
                    new_token_ids = tuple(request.token_ids[self._in_executor[request_id] :])
                    self._in_executor[request_id] = request.num_tokens
                cached_requests.append(
                    CachedRequestData(request_id, block_ids, request.num_computed_tokens, new_token_ids)
                )
            else:
                self._in_executor[request_id] = request.num_tokens
                new_requests.append(
                    NewRequestData(
                        request_id=request_id,
                        token_ids=tuple(request.token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling_params=request.sampling_params,
                        block_ids=self.kv.block_ids(request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        **({} if request.lora_slot is None else {"lora_slot": request.lora_slot}),
                        mm_inputs=request.mm_inputs,
                    )
                )
            num_scheduled[request_id] = num_new
            num_known = num_new - len(request.spec_token_ids)
            if request.spec_token_ids:
                spec_token_ids[request_id] = tuple(request.spec_token_ids)
            # All but a newly sampled token (the last one, past the prompt) is KV of a known token.
            is_fresh = request.num_computed_tokens + num_known == request.num_tokens > request.num_prompt_tokens
            self.num_prefill_tokens_computed += num_known - int(is_fresh)
            request.num_computed_tokens += num_new
            if request.mm_inputs:
                self._release_images(request, computed_only=True)
            is_sampled = request.num_computed_tokens == len(request.token_ids) + len(request.spec_token_ids)
            if request.grammar is not None and is_sampled:
                constrained.append(request)  # sampled this step, under its grammar (at each draft too)
        total = sum(num_scheduled.values())
        output = SchedulerOutput(
            new_requests=tuple(new_requests),
            cached_requests=tuple(cached_requests),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_request_ids=frozenset(self._finished_ids),
            preempted_request_ids=frozenset(self._preempted_ids),
            grammar_request_ids=tuple(request.request_id for request in constrained),
            grammar_bitmask=grammar_bitmask([r.grammar for r in constrained], [r.spec_token_ids for r in constrained])
            if constrained else None,
            kv_transfers=self.kv.take_transfers(),
            spec_token_ids=spec_token_ids,
            **({} if self.lora is None else {"lora_updates": self.lora.take_updates()}),
            **self._encoder_output(),
        )
        if not output.is_empty:  # an empty batch is not sent to the executor, so these wait for the next one
            self._finished_ids.clear()
            self._preempted_ids.clear()
            if self.encoder_cache is not None:
                self.encoder_cache.clear_freed()
            # What update_from_output (or fail_scheduled) pops when this batch's output comes back, oldest first.
            self._scheduled.append({request.request_id: request for request, _, _ in scheduled})
        return output

    def _encoder_output(self) -> dict:
        """SchedulerOutput's encoder fields (none without images)."""
        if self.encoder_cache is None:
            return {}
        return {"scheduled_encoder_inputs": self._encoder_inputs, "free_encoder_hashes": self.encoder_cache.freed}

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot is not None:
            self.lora.release(request.lora_request)
            request.lora_slot = None

    def _preempt(self, request: Request) -> None:
        self._release_lora(request)
        if request.mm_inputs:
            self._release_images(request, computed_only=False)
        if self.kv.preempt(request):
            self.num_swapped_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_computed_tokens = 0  # admission sets it again, from what was swapped out or cached
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.request_id in self._in_executor:
            del self._in_executor[request.request_id]
            self._preempted_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests; one output per change."""
        outputs = []
        if model_runner_output.lora_ready:
            self.lora.mark_ready(model_runner_output.lora_ready)
        scheduled = self._scheduled.popleft()
        sampled, all_logprobs = model_runner_output.sampled_token_ids, model_runner_output.logprobs
        any_finished = False
        prompt_logprobs = model_runner_output.prompt_logprobs
        for request_id, request in scheduled.items():
            if prompt_logprobs and request_id in prompt_logprobs:
                request.add_prompt_logprobs(*prompt_logprobs[request_id])
            token_ids = sampled.get(request_id)
            # Skip partial prefill chunks (nothing sampled) and requests aborted while the step ran.
            if not token_ids or request.is_finished or request.num_computed_tokens < len(request.token_ids):
                continue
            if not request.output_token_ids:
                self.num_prompt_tokens += request.num_prompt_tokens
            if request.spec_token_ids:
                self._settle_drafts(request, num_accepted=len(token_ids) - 1)
            logprobs = all_logprobs.get(request_id, ()) if request.sampling_params.logprobs is not None else ()
            for j, token_id in enumerate(token_ids):
                self.num_generation_tokens += 1
                if request.append_token(token_id, logprobs[j] if j < len(logprobs) else None):
                    if self.proposer is not None:  # later requests may draft from this one's tokens
                        self.proposer.request_finished(request.prompt_token_ids, request.output_token_ids)
                    self._release(request)
                    any_finished = True
                    break
            outputs.append(request.make_output())
        if any_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return outputs

    def _settle_drafts(self, request: Request, num_accepted: int) -> None:
        """Take the request's progress back over its rejected drafts (their KV is overwritten next step) and
        adapt how many it drafts next."""
        num_drafted = len(request.spec_token_ids)
        request.num_computed_tokens -= num_drafted - num_accepted
        maximum = self.config.speculative.num_speculative_tokens
        self.spec_policy.record_verification(num_drafted, num_accepted, maximum)
        request.num_draft_tokens = next_num_draft_tokens(num_drafted, num_accepted, request.num_draft_tokens, maximum)
        request.spec_token_ids = []

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish unfinished requests from outside (abort, failure): free their blocks now."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def fail_scheduled(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The step in flight failed: finish its requests, forgetting cache entries they may not have written.

        The executor may not have applied the batch's drop lists either, so they are sent again.
        """
        self._finished_ids |= scheduler_output.finished_request_ids
        self._preempted_ids |= scheduler_output.preempted_request_ids
        scheduled = self._scheduled.popleft()
        self.running = [request for request in self.running if not request.is_finished]
        unfinished_ids = [rid for rid, request in scheduled.items() if self.requests.get(rid) is request]
        self.kv.uncache_step()
        if self.encoder_cache is not None:  # the embeddings this step was to compute may not exist
            self.encoder_cache.forget(self._encoding)
        if self.lora is not None:  # the slots this step was to fill may hold anything now
            self.lora.forget_loads(scheduler_output.lora_updates)
        self.finish_requests(unfinished_ids, RequestStatus.FINISHED_ABORTED)
        # All of them: one may have finished before the failure without its output being delivered.
        return list(scheduled)

    def _release(self, request: Request) -> None:
        self._release_lora(request)
        if request.mm_inputs:
            self._release_images(request, computed_only=False)
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._in_executor:
            del self._in_executor[request.request_id]
            self._finished_ids.add(request.request_id)
