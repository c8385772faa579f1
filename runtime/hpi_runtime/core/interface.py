"""The contract between the scheduler (engine core) and the model executor.

Data flows one way: the scheduler emits a frozen `SchedulerOutput` each step; the executor runs the model
and answers with a frozen `ModelRunnerOutput`; the scheduler's `update_from_output` consumes it. The
executor keeps its own per-request state (token ids, block table, sampling state) keyed by request id,
so a step sends only what changed, as in vLLM v1:

- `new_requests`: requests the executor has not seen, or is seeing again after a preemption (their state
  was dropped): full token ids (prompt + output so far), the full block table, num_computed_tokens.
- `cached_requests`: requests the executor already holds: blocks appended since last step and the
  num_computed_tokens at the start of this step (with pipeline stages, also the tokens sampled since).
- `num_scheduled_tokens`: request id -> how many tokens to compute this step, in batch order. The tokens
  are token_ids[num_computed_tokens : num_computed_tokens + n] of the executor's copy.
- A request is sampled when its scheduled chunk reaches the end of its known tokens; the executor appends
  the sampled token to its own copy of the token ids (the scheduler appends it to the Request too).
- `finished_request_ids` / `preempted_request_ids`: drop the state of these before running this step.
- `grammar_request_ids` / `grammar_bitmask`: the requests sampled this step under a grammar (structured
  outputs) and the tokens each may take next: one row per sampled position, so 1 + its drafts rows for a
  request verifying drafts (the grammar as it stands after the drafts before that position), in order;
  every other logits row is sampled unconstrained.
- `spec_token_ids`: draft tokens (speculative decoding) scheduled after a request's known tokens; the executor
  verifies them and answers with the accepted ones plus one, so `sampled_token_ids` may hold several tokens.
- `lora_updates`: LoRA adapters copied into device slots (and dropped from host memory, or read into it in
  the background, reported back in `ModelRunnerOutput.lora_ready`) before the forward; a new request's
  `lora_slot` names the slot its tokens use (lora/slot_table.py decides).
- `scheduled_encoder_inputs` / `free_encoder_hashes`: images whose vision-encoder embeddings to compute before
  the forward (kept by the executor under the image's hash until the scheduler frees them), and those to drop.
  A chunk that meets an image's placeholder run reads its rows from there (core/encoder_cache_manager.py).
- `kv_transfers`: block copies between the device KV cache and the host-memory tier (core/host_tier.py),
  run before the forward: all device -> host copies first, then all host -> device ones. A step may
  carry transfers and no tokens (a request swapped out with nothing else to run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hpi_runtime.lora.slot_table import BASE_SLOT, NO_LORA_UPDATES, LoRAUpdates
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: tuple[int, ...]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    lora_slot: int = BASE_SLOT  # the device slot of its LoRA adapter (lora/slot_table.py); pinned while it runs
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its images (placeholder runs in token_ids), prompt order


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    # Pipeline parallelism only (vLLM's field): the tokens sampled since the executor last saw this request. With
    # one stage the executor appends what it samples itself; with several, only the last stage samples, so every
    # stage learns the tokens here, with the request's next step.
    new_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVTransfers:
    """One step's copies between the KV tiers, as block ids; every block appears in at most one pair."""

    to_host: tuple[tuple[int, int], ...] = ()  # (device block id, host block id): offloads and swaps, run first
    to_device: tuple[tuple[int, int], ...] = ()  # (host block id, device block id): loads, run second

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device)


NO_TRANSFERS = KVTransfers()


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    num_scheduled_tokens: Mapping[str, int]  # batch order = iteration order
    total_num_scheduled_tokens: int
    finished_request_ids: frozenset[str] = frozenset()
    preempted_request_ids: frozenset[str] = frozenset()
    grammar_request_ids: tuple[str, ...] = ()
    grammar_bitmask: torch.Tensor | None = None  # [rows of grammar_request_ids, ceil(vocab / 32)] int32
    kv_transfers: KVTransfers = NO_TRANSFERS
    # Speculative decoding: request id -> draft tokens to verify. They are the last len(drafts) of the request's
    # scheduled tokens (after its known ones); the executor samples every one of those positions and returns
    # the drafts it accepted plus the token after them.
    spec_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # LoRA adapters to drop from host memory and to copy into device slots, before the forward.
    lora_updates: LoRAUpdates = NO_LORA_UPDATES
    # Multimodal: request id -> indices (into its mm_inputs) of the images whose embeddings to compute this step,
    # before the forward; and the image hashes whose embeddings the executor may drop (evicted by the scheduler).
    scheduled_encoder_inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    free_encoder_hashes: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do: no token to compute and no block to copy."""
        return self.total_num_scheduled_tokens == 0 and not self.kv_transfers


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token plus the top-n alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs


@dataclass(frozen=True)
class ModelRunnerOutput:
    # request id -> sampled token ids this step (one per sampled request; empty for partial prefill chunks)
    sampled_token_ids: Mapping[str, tuple[int, ...]]
    logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, logprobs of the prompt tokens this step covered)
    prompt_logprobs: Mapping[str, tuple[int, tuple[TokenLogprobs, ...]]] = field(default_factory=dict)
    # LoRA: lora_int_ids of the prefetched adapters whose background read finished since the last step's output
    lora_ready: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemoryFootprint:
    """What a loaded model holds, measured by its executor: the one record the workers, the core process, the
    server's metrics and `LLM` all report. Bytes are summed over tensor-parallel ranks; block counts are per
    rank (every rank holds the same blocks)."""

    weight_bytes: int
    kv_cache_bytes: int
    num_kv_blocks: int
    block_size: int
    host_kv_cache_bytes: int = 0  # the host-memory KV tier, 0 when off
    num_host_kv_blocks: int = 0


class ExecutorDeadError(RuntimeError):
    """The executor can never run another step (a tensor-parallel worker process died). Unlike a failed
    step, which fails only its own requests, this ends the engine: the server reports itself unhealthy
    and exits so that its supervisor restarts it."""


KILLED_BY_SIGNAL = "was killed by signal"  # a worker's cause of death; its peers' broken connections follow from it


def describe_exit(exitcode: int | None) -> str:
    """How a worker process ended, from its multiprocessing exit code (negative: the signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        return f"{KILLED_BY_SIGNAL} {-exitcode}"
    return f"exited with code {exitcode}"


class ModelExecutor(Protocol):
    """What the engine needs from whatever runs the model: one process, or one worker per TP rank."""

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_host_kv_blocks(self) -> int:
        """Blocks of the host-memory KV tier (0: no tier); the same ids on every rank."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def sleep(self, level: int) -> int:
        """Between steps, with no request holding blocks: free the KV cache (level 1; on an accelerator also
        move the weights to host memory) or the KV cache and the weights (level 2). Returns the bytes freed;
        ValueError if this executor cannot sleep."""
        ...

    def wake_up(self) -> int:
        """Restore what `sleep` released (the same number of KV blocks, the same weights); returns the bytes."""
        ...

    def stage_busy_s(self) -> tuple[float, ...]:
        """Per pipeline stage: seconds spent computing, not waiting, since its first step (refreshed about once a
        second); () without pipeline parallelism."""
        ...

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(ExecutorDeadError)` (from any thread) if the executor dies between steps."""
        ...

    def shutdown(self) -> None: ...
