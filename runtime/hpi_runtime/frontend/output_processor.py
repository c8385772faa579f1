"""The frontend's record of every live request: turn the core's deltas into outputs.

`OutputProcessor` holds, per request, what the core does not: the detokenizer, stop-string matching and the
accumulated output. It runs in the API server's process (and in the offline `LLM`), so none of this work sits
inside the engine step. A stop string found here finishes the request at once; the caller then aborts it in
the core. It is also the one check that a request id is not already in use: it knows every live request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hpi_runtime.core.engine_io import EngineCoreOutput, EngineCoreRequest
from hpi_runtime.core.interface import TokenLogprobs
from hpi_runtime.frontend.detokenizer import IncrementalDetokenizer
from hpi_runtime.outputs import FINISH_ABORT, FINISH_STOP, RequestOutput, RequestOutputKind


class _RequestState:
    """One unfinished request as the frontend sees it (owned by the OutputProcessor)."""

    __slots__ = ("request", "kind", "detokenizer", "output_token_ids", "first_scheduled_time",
                 "num_cached_prompt_tokens", "prompt_logprobs")  # fmt: skip

    def __init__(self, request: EngineCoreRequest, kind: RequestOutputKind, tokenizer) -> None:
        self.request = request
        self.kind = kind
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.sampling_params)
        self.output_token_ids: list[int] = []
        self.first_scheduled_time: float | None = None
        self.num_cached_prompt_tokens = 0
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    def make_output(
        self,
        new_token_ids: tuple[int, ...],
        new_logprobs: tuple[TokenLogprobs, ...],
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> RequestOutput:
        finished = finish_reason is not None
        whole = finished or self.kind is RequestOutputKind.CUMULATIVE
        detokenizer = self.detokenizer
        text_delta = detokenizer.emit(finished)
        return RequestOutput(
            request_id=self.request.request_id,
            prompt_token_ids=self.request.prompt_token_ids,
            output_token_ids=tuple(self.output_token_ids) if whole else (),
            new_token_ids=new_token_ids,
            text=detokenizer.emitted_text if whole else "",
            text_delta=text_delta,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            new_logprobs=new_logprobs,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            arrival_time=self.request.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            prompt_logprobs=self.prompt_logprobs if whole else None,
        )


@dataclass(frozen=True)
class ProcessedOutputs:
    outputs: list[RequestOutput]
    request_ids_to_abort: list[str]  # finished here (a stop string) but still running in the core


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, request: EngineCoreRequest, kind: RequestOutputKind) -> None:
        """Track a request from here on; ValueError when its id is already in use (before any side effect)."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = _RequestState(request, kind, self.tokenizer)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Forget these requests; returns their final (aborted) outputs."""
        outputs = []
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is not None:
                outputs.append(state.make_output((), (), FINISH_ABORT, None))
        return outputs

    def process_outputs(self, core_outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        outputs, to_abort = [], []
        for core_output in core_outputs:
            state = self._requests.get(core_output.request_id)
            if state is None:  # aborted here while the core was stepping
                continue
            output = self._process_one(state, core_output)
            outputs.append(output)
            if output.finished:
                del self._requests[core_output.request_id]
                if not core_output.finished:
                    to_abort.append(core_output.request_id)
        return ProcessedOutputs(outputs, to_abort)

    def _process_one(self, state: _RequestState, core_output: EngineCoreOutput) -> RequestOutput:
        if core_output.first_scheduled_time is not None:
            state.first_scheduled_time = core_output.first_scheduled_time
            state.num_cached_prompt_tokens = core_output.num_cached_prompt_tokens
        if core_output.prompt_logprobs is not None:
            state.prompt_logprobs = core_output.prompt_logprobs
        params = state.request.sampling_params
        finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
        token_ids = core_output.new_token_ids
        # The core stops on tokens (EOS, stop_token_ids) before any text is made of them, as vLLM does: the
        # stop token itself is not detokenized.
        num_text_tokens = len(token_ids) - (1 if finish_reason == FINISH_STOP and token_ids else 0)
        num_kept = len(token_ids)
        outputs_so_far = len(state.output_token_ids)
        for j in range(num_text_tokens):
            stop_string = state.detokenizer.append(token_ids[j], outputs_so_far + j + 1 >= params.min_tokens)
            if stop_string is not None:
                finish_reason, stop_reason, num_kept = FINISH_STOP, stop_string, j + 1
                break
        kept = token_ids if num_kept == len(token_ids) else token_ids[:num_kept]
        state.output_token_ids.extend(kept)
        logprobs = core_output.new_logprobs[:num_kept]
        return state.make_output(kept, logprobs, finish_reason, stop_reason)
