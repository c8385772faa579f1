"""Run the choices of one API request on the async engine: prompt checks, n-way fan-out, timing.

Everything HTTP-shaped lives in the endpoint modules; this module turns prompts plus validated sampling
fields into engine requests and merges their output streams as (choice index, RequestOutput).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from hpi_runtime.frontend.input_processor import RequestError, check_max_tokens, check_prompt
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.outputs import FINISH_ABORT, RequestOutput
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.server.errors import ApiError, bad_request
from hpi_runtime.server.metrics import RequestTiming, ServingMetrics
from hpi_runtime.server.protocol import SamplingFields
from hpi_runtime.server.state import ServedModel
from hpi_runtime.structured.params import check


@dataclass(frozen=True)
class Choice:
    index: int
    request_id: str
    prompt_index: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None  # the adapter the request's 'model' named; None: the base model
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its prompt's images


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def plan_choices(
    base_id: str,
    prompts: Sequence[Sequence[int]],
    fields: SamplingFields,
    n: int,
    model: ServedModel,
    prompt_param: str,
    lora_request: LoRARequest | None = None,
    mm_inputs: tuple[MultiModalInput, ...] = (),
) -> list[Choice]:
    """One Choice per (prompt, i < n); the input processor checks token ids against the vocabulary and lengths
    against max_model_len (400 with the numbers). `prompt_param` names the request field the prompt came from;
    `mm_inputs`: the images of a single prompt."""
    max_model_len, vocab_size = model.max_model_len, model.vocab_size
    sent = {
        "temperature": fields.temperature, "top_p": fields.top_p, "top_k": fields.top_k, "min_p": fields.min_p,
        "repetition_penalty": fields.repetition_penalty,
    }  # fmt: skip
    sampling = {**model.sampling_defaults, **{k: v for k, v in sent.items() if v is not None}}
    if fields.stop_token_ids and max(fields.stop_token_ids) >= vocab_size:
        raise bad_request(
            f"token id {max(fields.stop_token_ids)} is outside the vocabulary of {vocab_size}", "stop_token_ids"
        )
    if fields.logit_bias and fields.logit_bias[-1][0] >= vocab_size:
        raise bad_request(f"token id {fields.logit_bias[-1][0]} is outside the vocabulary of {vocab_size}",
                          "logit_bias")
    choices = []
    for p, prompt_ids in enumerate(prompts):
        num_prompt = len(prompt_ids)
        max_tokens = fields.max_tokens if fields.max_tokens is not None else max_model_len - num_prompt
        try:
            check_prompt(prompt_ids, max_model_len, vocab_size, prompt_param)
            check_max_tokens(num_prompt, max_tokens, max_model_len)
        except RequestError as exc:
            raise bad_request(str(exc), exc.param, exc.code) from exc
        for i in range(n):
            seed = None if fields.seed is None else fields.seed + i  # n choices: reproducible, yet distinct
            try:
                params = SamplingParams(
                    max_tokens=max_tokens,
                    **sampling,
                    seed=seed,
                    stop=fields.stop,
                    stop_token_ids=fields.stop_token_ids,
                    ignore_eos=fields.ignore_eos,
                    min_tokens=min(fields.min_tokens, max_tokens),
                    presence_penalty=fields.presence_penalty,
                    frequency_penalty=fields.frequency_penalty,
                    logprobs=fields.logprobs,
                    logit_bias=fields.logit_bias,
                    structured_outputs=fields.structured,
                    skip_special_tokens=fields.skip_special_tokens,
                    prompt_logprobs=fields.prompt_logprobs,
                )
            except ValueError as exc:
                raise bad_request(str(exc)) from exc
            index = len(choices)
            choices.append(
                Choice(index, f"{base_id}-{index}", p, tuple(prompt_ids), params, fields.priority, lora_request,
                       mm_inputs)  # fmt: skip
            )
    return choices


async def check_structured(fields: SamplingFields) -> None:
    """A 400 naming the problem if the request's grammar cannot be compiled; parsed in a thread, so a large
    schema never stalls the event loop. (The engine core compiles it for real, once per grammar.)"""
    if fields.structured is None:
        return
    try:
        await asyncio.to_thread(check, fields.structured)
    except ValueError as exc:
        param = {"json": "response_format", "json_object": "response_format"}.get(fields.structured.kind,
                                                                                f"guided_{fields.structured.kind}")
        raise bad_request(str(exc), param) from exc


class _Timer:
    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.queue_s: float | None = None
        self.num_tokens = 0

    def tick(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.first_scheduled_time is not None and self.queue_s is None:
            self.queue_s = max(0.0, out.first_scheduled_time - out.arrival_time)
        if not out.new_token_ids:
            return
        self.num_tokens += len(out.new_token_ids)
        if self.first is None:
            self.first = now
        elif self.last is not None:
            # Several tokens in one delivery share the gap (rare: only when the consumer falls behind).
            gap = (now - self.last) / len(out.new_token_ids)
            self.gaps.extend([gap] * len(out.new_token_ids))
        self.last = now

    def timing(self) -> RequestTiming:
        first = None if self.first is None else self.first - self.start
        return RequestTiming(first, tuple(self.gaps), time.monotonic() - self.start, self.queue_s, self.num_tokens,
                             self.num_prompt_tokens)  # fmt: skip


async def stream_choices(
    engine, metrics: ServingMetrics, choices: Sequence[Choice]
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run all choices concurrently; yield their outputs as they come; cancel them all on early exit."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        timer = _Timer(len(choice.prompt_token_ids))
        finish = FINISH_ABORT
        accepted = True
        try:
            async for out in engine.generate(choice.request_id, list(choice.prompt_token_ids), choice.params,
                                             choice.priority, choice.lora_request, choice.mm_inputs):
                timer.tick(out)
                if out.finished:
                    finish = out.finish_reason or FINISH_ABORT
                await queue.put((choice, out, None))
        except asyncio.CancelledError:
            raise
        except ValueError as exc:  # the engine refused it before any output (queue full, invalid)
            accepted = False
            await queue.put((choice, None, exc))
        except Exception as exc:  # handed to the consumer, which maps it to an HTTP error
            await queue.put((choice, None, exc))
        finally:
            if accepted:  # a refused request never ran: it is neither a success nor a latency sample
                metrics.observe_request(timer.timing(), finish)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, out, error = await queue.get()
            if error is not None:
                raise error
            yield choice, out
            if out.finished:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(
    engine, metrics: ServingMetrics, choices: Sequence[Choice]
) -> list[tuple[Choice, RequestOutput]]:
    """Non-streaming: each choice's final cumulative output, with every step's logprobs gathered in."""
    logprobs: dict[int, list] = {c.index: [] for c in choices}
    last: dict[int, RequestOutput] = {}
    async for choice, out in stream_choices(engine, metrics, choices):
        logprobs[choice.index].extend(out.new_logprobs)
        last[choice.index] = out
    if len(last) != len(choices):
        raise ApiError(500, "the engine finished a request without output")
    return [(c, replace(last[c.index], new_logprobs=tuple(logprobs[c.index]))) for c in choices]
