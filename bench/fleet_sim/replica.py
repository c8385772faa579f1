"""One simulated replica, behaving like our engine's scheduler (runtime/hpi_runtime/core/scheduler.py) with its
step time taken from the pool's profile, and advanced analytically between its own events.

The engine's rule: each step, every running sequence catches up under a token budget: each decoding sequence
adds one token, and what is left of `max_num_batched_tokens` goes to the prompts being prefilled, first come
first served (chunked prefill). A step with `b` decoding sequences and `c` prefill tokens takes
    alpha + beta * b + c / prefill_tokens_per_s
(the profile's decode line plus the prefill tokens at the profile's prefill rate). Sequences are admitted at step
boundaries while fewer than `max_num_seqs` run and the KV budget holds their prompt; when the decode growth
would overflow the KV budget, the newest running sequence is preempted by recompute (its KV freed, it goes back
to the front of the queue and later prefills its prompt plus the tokens it had generated).

Between two changes of the batch (a prefill finishing, a sequence finishing, the KV budget filling, a queued
request being admitted) every step is the same, so the replica jumps there in one move: a step counter, the
decode finish steps in a heap, and one event per change instead of one per step. Arrivals and scrapes in between
only move the replica to its last step boundary before them (`advance`). A request that arrives at a busy replica
waits for the next step boundary, as in the engine; one that finds the replica idle starts at once.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from hpi_operator.fleet.performance import PoolPerformance


@dataclass(frozen=True)
class EngineShape:
    """How one replica runs: the pool's measured (or assumed) speed and the engine's limits."""

    performance: PoolPerformance
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must exceed max_num_seqs (decodes would starve prefill)")


class Seq:
    """One request's progress on a replica (owned by the replica until it finishes)."""

    __slots__ = ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "generated", "prefill_left",
                 "first_token_s", "finish_s", "done_step", "order", "kv_base", "generated_at_admit", "state",
                 "num_preemptions", "replica")  # fmt: skip

    def __init__(self, request_id: int, arrival_s: float, prompt_tokens: int, output_tokens: int):
        self.request_id, self.arrival_s = request_id, arrival_s
        self.prompt_tokens, self.output_tokens = prompt_tokens, output_tokens
        self.generated = 0
        self.prefill_left = prompt_tokens
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.done_step = 0  # while decoding: the step whose end brings its last token
        self.order = 0  # admission order: the newest is preempted first
        self.kv_base = 0  # KV tokens reserved at admission (the prompt, plus generated tokens on a recompute)
        self.generated_at_admit = 0
        self.state = "waiting"  # waiting | prefill | decode | done
        self.num_preemptions = 0
        self.replica = ""


def _live(entry: tuple[int, int, Seq]) -> bool:
    """A decode-heap entry still describes its sequence (preemption leaves stale ones behind)."""
    done_step, order, seq = entry
    return seq.state == "decode" and seq.done_step == done_step and seq.order == order


class Replica:
    def __init__(self, name: str, shape: EngineShape):
        self.name, self.shape = name, shape
        perf = shape.performance
        self._alpha, self._beta, self._inv_prefill = perf.itl_alpha_s, perf.itl_beta_s, 1 / perf.prefill_tokens_per_s
        self.t_s = 0.0  # time of the last step boundary
        self.steps = 0
        self.waiting: deque[Seq] = deque()
        self.prefilling: deque[Seq] = deque()
        self._decode_heap: list[tuple[int, int, Seq]] = []
        self.num_decoding = 0
        self.running: dict[int, Seq] = {}  # admission order -> sequence (insertion ordered: newest last)
        self._pending_prefill = 0
        self.kv_used = 0
        self._next_order = 0
        # Until the next event: tokens per step for prefill, the step time, the steps left.
        self._chunk, self.step_s, self._steps_left = 0, 0.0, 0
        self.event_s: float | None = None
        self.version = 0  # bumped at each re-plan: the engine drops events of older versions
        # The counters a scrape reads (vLLM's names in the runtime).
        self.num_finished = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions = 0

    # -- what a scrape sees --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.shape.kv_capacity_tokens

    # -- inputs --------------------------------------------------------------------------------------------
    def submit(self, seq: Seq, now_s: float) -> None:
        """A new request. Idle: it starts now. Busy: it queues for the next step boundary."""
        seq.replica = self.name
        if not self.busy:
            self.t_s = now_s
            self.waiting.append(seq)
            self._admit()
        else:
            self.advance(now_s)
            self.waiting.append(seq)
        self._plan()

    def advance(self, now_s: float) -> None:
        """Move to the last step boundary at or before `now_s`, short of the next event (the batch is unchanged)."""
        if self._steps_left <= 1 or now_s <= self.t_s:
            return
        n = min(int((now_s - self.t_s) / self.step_s), self._steps_left - 1)
        if n > 0:
            self._run(n)
            self.t_s += n * self.step_s
            self._steps_left -= n

    def on_event(self, now_s: float) -> list[Seq]:
        """The planned event is due: run the steps up to it, settle the batch, plan the next. Returns the finished."""
        self._run(self._steps_left)
        self.t_s = now_s
        finished = self._settle(now_s)
        self._plan()
        return finished

    # -- the engine's rule ---------------------------------------------------------------------------------
    def _run(self, n: int) -> None:
        """n identical steps of the current batch."""
        if n <= 0:
            return
        self.steps += n
        grown = n * self.num_decoding
        self.kv_used += grown
        self.generation_tokens_total += grown
        tokens = n * self._chunk
        self._pending_prefill -= tokens
        for seq in self.prefilling:  # first come, first served
            if tokens <= 0:
                break
            take = min(seq.prefill_left, tokens)
            seq.prefill_left -= take
            tokens -= take

    def _settle(self, now_s: float) -> list[Seq]:
        finished: list[Seq] = []
        while self.prefilling and self.prefilling[0].prefill_left <= 0:
            seq = self.prefilling.popleft()
            self._emit_token(seq, now_s, finished)
        heap = self._decode_heap
        while heap and heap[0][0] <= self.steps:
            entry = heapq.heappop(heap)
            if _live(entry):
                seq = entry[2]
                self.num_decoding -= 1
                seq.generated = seq.output_tokens
                self._finish(seq, now_s, finished)
        while self.num_decoding and self.kv_used + self.num_decoding > self.shape.kv_capacity_tokens:
            self._preempt_newest()
        self._admit()
        return finished

    def _emit_token(self, seq: Seq, now_s: float, finished: list[Seq]) -> None:
        """The step that completes a (re)prefill also samples the next token."""
        if seq.first_token_s is None:
            seq.first_token_s = now_s
        seq.generated += 1
        self.kv_used += 1
        self.generation_tokens_total += 1
        if seq.generated >= seq.output_tokens:
            self._finish(seq, now_s, finished)
            return
        seq.state = "decode"
        seq.done_step = self.steps + seq.output_tokens - seq.generated
        heapq.heappush(self._decode_heap, (seq.done_step, seq.order, seq))
        self.num_decoding += 1

    def _held(self, seq: Seq) -> int:
        return seq.kv_base + seq.generated - seq.generated_at_admit

    def _finish(self, seq: Seq, now_s: float, finished: list[Seq]) -> None:
        seq.state, seq.finish_s = "done", now_s
        self.kv_used -= self._held(seq)
        del self.running[seq.order]
        self.num_finished += 1
        self.prompt_tokens_total += seq.prompt_tokens
        finished.append(seq)

    def _preempt_newest(self) -> None:
        order = next(reversed(self.running))
        seq = self.running.pop(order)
        if seq.state == "decode":
            seq.generated = seq.output_tokens - (seq.done_step - self.steps)
            self.num_decoding -= 1  # its heap entry goes stale (state checked on pop)
        else:
            self.prefilling.remove(seq)
            self._pending_prefill -= seq.prefill_left
        self.kv_used -= self._held(seq) if seq.state == "decode" else seq.kv_base
        seq.state = "waiting"
        seq.prefill_left = seq.prompt_tokens + seq.generated  # recompute
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self) -> None:
        cap = self.shape.kv_capacity_tokens
        while self.waiting and len(self.running) < self.shape.max_num_seqs:
            seq = self.waiting[0]
            need = seq.prefill_left
            if self.kv_used + need + self.num_decoding > cap:
                if self.running:
                    break
                raise ValueError(f"{self.name}: a {need}-token prompt exceeds the KV budget of {cap} tokens")
            self.waiting.popleft()
            self.kv_used += need
            seq.kv_base, seq.generated_at_admit, seq.state = need, seq.generated, "prefill"
            seq.order = self._next_order
            self._next_order += 1
            self.running[seq.order] = seq
            self.prefilling.append(seq)
            self._pending_prefill += need

    def _plan(self) -> None:
        """Step time and steps to the next change of the batch, for the current batch."""
        self.version += 1
        b = self.num_decoding
        chunk = min(max(self.shape.max_num_batched_tokens - b, 0), self._pending_prefill)
        candidates = []
        if chunk > 0:
            head = self.prefilling[0].prefill_left
            # Whole chunks first, then one step that finishes the head with the next prompts' tokens beside it.
            candidates.append(head // chunk if head >= chunk else 1)
        heap = self._decode_heap
        while heap and not _live(heap[0]):
            heapq.heappop(heap)
        if heap:
            candidates.append(heap[0][0] - self.steps)
        if b:
            candidates.append(max(1, (self.shape.kv_capacity_tokens - self.kv_used) // b))
        if (
            self.waiting
            and len(self.running) < self.shape.max_num_seqs
            and (self.kv_used + self.waiting[0].prefill_left + b <= self.shape.kv_capacity_tokens)
        ):
            candidates.append(1)
        if not candidates:
            self._chunk, self.step_s, self._steps_left, self.event_s = 0, 0.0, 0, None
            return
        self._chunk = chunk
        self.step_s = self._alpha + self._beta * b + chunk * self._inv_prefill
        self._steps_left = max(1, min(candidates))
        self.event_s = self.t_s + self._steps_left * self.step_s
        assert math.isfinite(self.event_s)
