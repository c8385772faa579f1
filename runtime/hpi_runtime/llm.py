"""The offline API: `LLM.generate` / `LLM.chat`, like vLLM's, over an engine in this process.

`LLM(model, **options)` takes every engine option of the config tree (hpi_runtime/config.py) as a keyword
argument, with the same names and defaults as `hpi serve`'s flags; `model=None` means the embedded
SmolLM2-135M-Instruct. Assembling the engine is engine_factory.py's job, which the server shares.
With `enable_lora=True`, `generate(..., lora_request=LoRARequest(name, id, path))` runs prompts with a PEFT
adapter (one for all prompts, or one per prompt, None for the base model), mixed in the same batches.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpi_runtime.config import EngineArgs, engine_options
from hpi_runtime.core.interface import TokenLogprobs
from hpi_runtime.engine_factory import create_engine
from hpi_runtime.frontend.engine import QueueFullError
from hpi_runtime.lora.registry import LoRARegistry
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.outputs import RequestOutput, RequestOutputKind
from hpi_runtime.sampling_params import SamplingParams

Message = dict[str, str]
# Text, token ids, or vLLM's TextPrompt {"prompt": text} / TokensPrompt {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | dict[str, Any]


def _items(value: object) -> list | None:
    """The elements of a list, tuple, array or tensor; None for text, a dict or a scalar."""
    if isinstance(value, (str, bytes, dict)):
        return None
    try:
        return list(value)  # type: ignore[call-overload]
    except TypeError:
        return None


def _is_token_id(value: object) -> bool:
    """An integer (numpy's and torch's too, through __index__), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


class LLM:
    """Offline batch generation over the same engine the server runs.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...          SamplingParams(temperature=0))[0].text
    'The capital of France is Paris.'
    """

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        # The keyword arguments are the config tree's options (hpi_runtime/config.py); `__signature__` below
        # lists them, so help(LLM) and editors show every one with its default.
        self.bundle = create_engine(EngineArgs.from_options(model=None if model is None else str(model), **options))
        self.engine = self.bundle.engine
        self.tokenizer = self.bundle.resolved.tokenizer
        self._request_counter = itertools.count()
        resolved = self.bundle.resolved
        self.lora_registry = None
        if resolved.args.lora.enable_lora:
            self.lora_registry = LoRARegistry(resolved.model_config, resolved.args.lora.max_lora_rank)
            for module in resolved.args.lora.modules:
                self.lora_registry.load(module.name, module.path, module.base_model_name)

    def shutdown(self) -> None:
        """Release the KV cache and stop tensor-parallel worker processes (also done by `with LLM(...)`)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.bundle.resolved.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return the final outputs in prompt order. A prompt is text, token ids, or
        as in vLLM {"prompt": text} or {"prompt_token_ids": ids}; one prompt or a list of them.
        `priority`: one per prompt, lower is admitted first (as vLLM's); None: all 0, first come first served.
        `lora_request`: the adapter for every prompt, or one per prompt (None: the base model).
        ValueError, before anything runs, for a prompt of another kind or a token id outside the vocabulary."""
        items = _items(prompts)
        if items is None or (items and _is_token_id(items[0])):  # one prompt: text, a dict, token ids
            items = [prompts]
        token_ids = [self._prompt_ids(p, i) for i, p in enumerate(items)]
        return self._run(token_ids, sampling_params, priority, lora_request)

    def _prompt_ids(self, prompt: Prompt, index: int) -> list[int]:
        """One prompt's token ids, checked against the vocabulary."""
        if isinstance(prompt, dict):
            known = {"prompt", "prompt_token_ids"} & set(prompt)
            if len(known) != 1 or set(prompt) - known:
                raise ValueError(f"prompt {index}: a dict prompt takes one key, 'prompt' (text) or 'prompt_token_ids' "
                                 f"(token ids), got {sorted(prompt)}")  # fmt: skip
            prompt = prompt[known.pop()]
        if isinstance(prompt, str):
            # With special tokens, as the server and vLLM's LLM.generate do: Llama 2/3 prompts need their BOS.
            return list(self.tokenizer(prompt).input_ids)
        tokens = _items(prompt)
        if tokens is None or not all(_is_token_id(t) for t in tokens):
            raise ValueError(f"prompt {index}: expected text or a list of token ids (integers), got "
                             f"{type(prompt).__name__} {str(prompt)[:80]}")  # fmt: skip
        ids = [operator.index(t) for t in tokens]
        vocab_size = self.bundle.resolved.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"prompt {index}: token id {bad} is outside the vocabulary of {vocab_size}")
        return ids

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_ids = [
            list(
                self.tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            )
            for c in conversations
        ]
        return self._run(token_ids, sampling_params, priority, lora_request)

    def _run(
        self,
        token_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        loras = self._loras(lora_request, len(token_ids))
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(token_ids)
        params = list(sampling_params)
        if len(params) != len(token_ids):
            raise ValueError(f"{len(params)} sampling params for {len(token_ids)} prompts")
        priorities = [0] * len(token_ids) if priority is None else list(priority)
        if len(priorities) != len(token_ids):
            raise ValueError(f"{len(priorities)} priorities for {len(token_ids)} prompts")
        request_ids = [f"llm-{next(self._request_counter)}" for _ in token_ids]
        lora_of = dict(zip(request_ids, loras, strict=True))
        for request_id, ids, p in zip(request_ids, token_ids, params, strict=True):
            # validate everything before running anything
            self.engine.make_request(request_id, ids, p, lora_request=lora_of[request_id])
        pending = list(zip(request_ids, token_ids, params, strict=True))[::-1]
        priority_of = dict(zip(request_ids, priorities, strict=True))
        finished: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {r: [] for r in request_ids}
        while pending or self.engine.has_unfinished_requests():
            while pending:
                try:
                    # DELTA: only the final output carries the whole text, and only it is kept.
                    request_id = pending[-1][0]
                    self.engine.add_request(
                        *pending[-1],
                        priority=priority_of[request_id],
                        output_kind=RequestOutputKind.DELTA,
                        lora_request=lora_of[request_id],
                    )
                except QueueFullError:
                    break
                pending.pop()
            for output in self.engine.step():
                logprobs[output.request_id].extend(output.new_logprobs)
                if output.finished:
                    # The caller sees one output per request, so its delta is everything.
                    finished[output.request_id] = dataclasses.replace(
                        output,
                        new_token_ids=output.output_token_ids,
                        text_delta=output.text,
                        new_logprobs=tuple(logprobs[output.request_id]),
                    )
        return [finished[r] for r in request_ids]

    def _loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """One checked adapter (or None) per prompt."""
        if lora_request is None:
            return [None] * num_prompts
        if self.lora_registry is None:
            raise ValueError("lora_request needs an LLM built with enable_lora=True")
        loras = [lora_request] * num_prompts if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(f"{len(loras)} lora requests for {num_prompts} prompts")
        return [None if lora is None else self.lora_registry.check(lora) for lora in loras]


def _options_signature() -> inspect.Signature:
    """LLM.__init__'s signature as the config tree declares it: (self, model=None, *, <every other option>)."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for spec in engine_options():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if spec.name == "model" else inspect.Parameter.KEYWORD_ONLY
        annotation = spec.type if spec.default is not None else spec.type | None
        params.append(inspect.Parameter(spec.name, kind, default=spec.default, annotation=annotation))
    params.sort(key=lambda p: p.kind)  # model (positional) first
    return inspect.Signature(params)


def _options_doc() -> str:
    lines = ["", "", "Options (hpi_runtime/config.py; the same as `hpi serve`'s flags):"]
    lines += [f"    {spec.name}={spec.default!r}: {spec.info.help}" for spec in engine_options()]
    return "\n".join(lines)


LLM.__init__.__signature__ = _options_signature()
LLM.__doc__ = (LLM.__doc__ or "") + _options_doc()
