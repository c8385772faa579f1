"""A request's progress: its tokens, how many have KV computed, its status and its stop conditions.

The request is the one owner of this state; the scheduler moves it between queues and the KV cache
manager holds its blocks. Full-block hashes are computed once per block as tokens arrive. Text (detokenizing,
stop strings) is the frontend's business: a request here is token ids only.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpi_runtime.core.block_pool import BlockHash, HashFn, hash_block_tokens
from hpi_runtime.core.engine_io import EngineCoreOutput
from hpi_runtime.core.interface import TokenLogprobs
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.multimodal.inputs import MultiModalInput, mm_extra_keys
from hpi_runtime.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from hpi_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hpi_runtime.structured.compiler import RequestGrammar

logger = logging.getLogger(__name__)


class RequestStatus(str, enum.Enum):  # str first: C-level hashing, these are checked per token
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = FINISH_STOP
    FINISHED_LENGTH = FINISH_LENGTH
    FINISHED_ABORTED = FINISH_ABORT

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(frozen=True)
class BlockHasher:
    """How full blocks are named in the prefix cache; `root_hash` seeds the chain (injectable for tests)."""

    block_size: int
    hash_fn: HashFn
    root_hash: BlockHash = b""


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "max_tokens", "arrival_time", "priority", "token_ids",
        "output_token_ids", "num_computed_tokens", "status", "stop_reason", "first_scheduled_time",
        "num_cached_prompt_tokens", "num_preemptions", "stop_token_ids", "block_hashes",
        "grammar", "prompt_logprobs", "spec_token_ids", "num_draft_tokens", "_hasher", "_num_sent_tokens",
        "_new_logprobs", "lora_request", "lora_slot", "_extra_keys", "mm_inputs",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float,
        priority: int = 0,
        hasher: BlockHasher | None = None,
        grammar: RequestGrammar | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # already capped by max_model_len
        self.arrival_time = arrival_time
        self.priority = priority  # lower is admitted first, as in vLLM
        self.token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the requested stop token id that finished it
        self.first_scheduled_time: float | None = None
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids
        )
        self.block_hashes: list[BlockHash] = []
        self.grammar = grammar  # structured outputs: advanced with every token, masks the next one
        self.prompt_logprobs: list[TokenLogprobs] = []  # of prompt tokens 1.. (sent with the first output)
        # Speculative decoding: the drafts scheduled for verification this step (after token_ids; never in
        # them, nor in the block hashes, until accepted), and how many to propose next (adapted per request).
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.lora_request = lora_request
        self.lora_slot: int | None = None  # the adapter's device slot while it runs (None: holds none)
        # In every block hash: two adapters (or an adapter and the base model) never share KV.
        self._extra_keys = () if lora_request is None else ("lora", lora_request.lora_int_id)
        self.mm_inputs = mm_inputs  # images: a block meeting one's placeholders has its hash among its keys
        self._hasher = hasher
        self._num_sent_tokens = 0
        self._new_logprobs: list[TokenLogprobs] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Add one sampled token and apply the stop conditions; True when the request is now finished."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self._new_logprobs.append(logprobs)
        if self._hasher is not None and len(self.token_ids) % self._hasher.block_size == 0:
            self._update_block_hashes()
        if self.grammar is not None and self._grammar_ends(token_id):
            return self._finish(RequestStatus.FINISHED_STOPPED, None)
        checks_stops = len(self.output_token_ids) >= self.sampling_params.min_tokens
        if checks_stops and token_id in self.stop_token_ids:
            # vLLM's convention: stop_reason names a stop the user asked for; EOS itself reports None.
            asked = token_id in self.sampling_params.stop_token_ids
            return self._finish(RequestStatus.FINISHED_STOPPED, token_id if asked else None)
        if len(self.output_token_ids) >= self.max_tokens:
            return self._finish(RequestStatus.FINISHED_LENGTH, None)
        return False

    def add_prompt_logprobs(self, first_index: int, logprobs: tuple[TokenLogprobs, ...]) -> None:
        """Logprobs of prompt tokens first_index.. (index 0 has none); a chunk computed again after a
        preemption adds nothing new."""
        known = len(self.prompt_logprobs) + 1  # the index of the next prompt token without logprobs
        if first_index <= known < first_index + len(logprobs):
            self.prompt_logprobs.extend(logprobs[known - first_index :])

    def _grammar_ends(self, token_id: int) -> bool:
        """Advance the grammar; True when nothing may follow (its stop token was accepted) or, against the
        mask (a banned stop token left no allowed one), the token broke it."""
        if not self.grammar.accept_token(token_id):
            logger.warning("request %s: token %d is outside its grammar; stopping it", self.request_id, token_id)
            return True
        return self.grammar.is_terminated

    def _finish(self, status: RequestStatus, stop_reason: int | None) -> bool:
        self.status, self.stop_reason = status, stop_reason
        return True

    def _update_block_hashes(self) -> None:
        hasher = self._hasher
        if hasher is None:
            return
        size = hasher.block_size
        while (len(self.block_hashes) + 1) * size <= len(self.token_ids):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else hasher.root_hash
            extra_keys = self._extra_keys
            if self.mm_inputs:
                extra_keys += mm_extra_keys(self.mm_inputs, start, start + size)
            self.block_hashes.append(
                hash_block_tokens(hasher.hash_fn, parent, self.token_ids[start : start + size], extra_keys)
            )

    def make_output(self) -> EngineCoreOutput:
        """What changed since the previous output of this request: its new tokens and, at the end, why."""
        finished = self.status in _FINISHED
        new_token_ids = tuple(self.output_token_ids[self._num_sent_tokens :])
        self._num_sent_tokens = len(self.output_token_ids)
        new_logprobs = ()
        if self._new_logprobs:
            new_logprobs, self._new_logprobs = tuple(self._new_logprobs), []
        prompt_logprobs = None
        if self._num_sent_tokens == len(new_token_ids) and self.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = tuple(self.prompt_logprobs)  # the first output: the whole prompt has run
        return EngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=self.status.value if finished else None,
            stop_reason=self.stop_reason,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            first_scheduled_time=self.first_scheduled_time,
            prompt_logprobs=prompt_logprobs,
        )
