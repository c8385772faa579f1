"""The contract between the frontend (tokenizing, detokenizing, streaming) and the engine core.

Frontend -> core: `EngineCoreRequest` (token ids and sampling settings), aborts by request id, and sleep/wake
(vLLM's sleep mode: each answered by one `SleepAnswer` once done).
Core -> frontend: per step, one `EngineCoreOutput` per request that changed, carrying only what is new, and an
`EngineStats` snapshot. These cross a process boundary (core/core_process.py) as pickles. The per-step ones
(`CoreOutputs`, `EngineCoreOutput`, `EngineStats`) are msgspec Structs: a step's deltas for 64 requests pickle
and unpickle ~6x faster than the same frozen dataclasses (bench/bench_engine_process.py); the rest, sent once
per request or once per process, stay dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from hpi_runtime.core.interface import MemoryFootprint, TokenLogprobs
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    """A validated, tokenized request as the core receives it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    max_tokens: int  # already capped so that prompt + output fits max_model_len
    arrival_time: float  # time.monotonic() in the frontend (the same clock in every process of the host)
    priority: int = 0
    lora_request: LoRARequest | None = None  # the adapter to run it with; None: the base model
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its images, in prompt order (multimodal/inputs.py)


class EngineCoreOutput(msgspec.Struct, frozen=True, gc=False):
    """What changed for one request in one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None  # set on the request's last output: "stop", "length" or "abort"
    stop_reason: int | None = None  # the requested stop token id that ended it; None for EOS or length
    num_cached_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # on the first output, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, frozen=True, gc=False):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use over all blocks (cached free blocks count as free)
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # The host KV tier (all 0 without one) and what it saves.
    num_swapped_preemptions: int = 0  # preemptions resumed from the host tier rather than recomputed
    num_prefill_tokens_computed: int = 0  # cumulative: KV built for known tokens (prompts, recomputes)
    prefix_cache_host_hits: int = 0  # cumulative tokens, part of prefix_cache_hits, found in the host tier
    kv_host_usage: float = 0.0  # 0..1, host blocks held by swapped requests or copies in flight
    kv_host_cached_blocks: int = 0  # host blocks holding offloaded prefix KV
    kv_blocks_to_host: int = 0  # cumulative block copies device -> host (offloads and swaps)
    kv_blocks_to_device: int = 0  # cumulative block copies host -> device (loads)
    # Speculative decoding (all 0 without it), cumulative as vLLM's spec_decode counters.
    spec_num_drafts: int = 0  # verifications: request-steps with at least one draft token
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # [num_speculative_tokens]: drafts accepted at each position
    # LoRA (all empty or 0 without it): adapter names with running / waiting requests, cumulative moves.
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_slot_loads: int = 0  # adapters copied into a device slot
    lora_host_evictions: int = 0  # adapters dropped from host memory (least recently used)
    # Multimodal (all 0 without images): the encoder cache (core/encoder_cache_manager.py), cumulative in images.
    encoder_cache_queries: int = 0  # images whose embeddings a prefill needed
    encoder_cache_hits: int = 0  # of those, found already computed
    encoder_cache_usage: float = 0.0  # 0..1, embedding rows held for running requests over the cache's size
    # Pipeline parallelism (empty without it): per stage, cumulative seconds computing rather than waiting.
    pipeline_stage_busy_s: tuple[float, ...] = ()


# Frontend -> core messages.
@dataclass(frozen=True)
class AddRequest:
    request: EngineCoreRequest


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Stop the loop; the core aborts what is left and stops its executor."""


@dataclass(frozen=True)
class Sleep:
    """Free the KV cache (level 1) or the KV cache and the weights (level 2); answered by a SleepAnswer."""

    level: int = 1


@dataclass(frozen=True)
class WakeUp:
    """Restore what Sleep released; answered by a SleepAnswer."""


# Core -> frontend messages.
@dataclass(frozen=True)
class CoreInfo:
    """Sent once by a core process when its model is loaded and its KV cache allocated."""

    footprint: MemoryFootprint
    # Seconds per start-up phase in the core (hpi_runtime/startup.py: load, quantize, layout, kv_cache, compile;
    # with tensor parallelism the slowest rank's).
    startup: tuple[tuple[str, float], ...] = ()


class CoreOutputs(msgspec.Struct, frozen=True, gc=False):
    """One step's deltas (possibly none, after aborts) and the core's state after it."""

    outputs: tuple[EngineCoreOutput, ...]
    stats: EngineStats


@dataclass(frozen=True)
class RequestRejected:
    """The core refused a request the frontend sent (a full queue, a duplicate id)."""

    request_id: str
    message: str
    queue_full: bool
    sleeping: bool = False  # the core is asleep (the frontend refuses requests first; this closes the race)


@dataclass(frozen=True)
class StepFailed:
    """A step failed; these requests were finished and freed. The core goes on."""

    request_ids: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class CoreDead:
    """The core can run no further step (its executor died, a bug, or loading failed). settings: loading failed
    on a ValueError, a setting the model cannot run with (a KV cache too small for one request, say)."""

    message: str
    settings: bool = False


@dataclass(frozen=True)
class SleepAnswer:
    """The answer to one Sleep or WakeUp, in the order they were sent. `error_kind` says why it was refused
    ("busy": requests are running or waiting; "invalid": a bad level, or an executor that cannot sleep)."""

    is_sleeping: bool
    level: int  # the sleep level now (0: awake)
    num_bytes: int = 0  # freed by a Sleep, restored by a WakeUp; 0 for a no-op or a refusal
    seconds: float = 0.0
    error: str | None = None
    error_kind: str | None = None
