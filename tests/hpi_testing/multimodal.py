"""Running a vision-language model through the real engine in tests and benchmarks: an engine over a model
directory, chat prompts with images (the model's own processor), a spy on the runner's logits, run to the end."""

from __future__ import annotations

import torch

from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import create_engine
from hpi_runtime.models.config import load_model_config
from hpi_runtime.multimodal.processor import ImageProcessor
from hpi_runtime.sampling_params import SamplingParams

ATOL = 2e-4  # fp32
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_engine(model_dir, **options):
    options = {"model": str(model_dir), "dtype": "float32", "enforce_eager": True, "max_model_len": 512,
               "kv_cache_memory_bytes": 4 << 20, **options}  # fmt: skip
    return create_engine(EngineArgs.from_options(**options)).engine


def chat_prompt(engine, model_dir, text: str, images) -> tuple[list[int], tuple]:
    """Chat-template a user message with `images` before `text`; the processor expands the placeholders."""
    config = load_model_config(model_dir)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    ids = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    return ImageProcessor(model_dir, config.architecture, config.vision).process(ids, images)


def record_logits(engine) -> list[tuple[str, list[int], torch.Tensor]]:
    """A spy on the runner: every sampled row's (request id, its tokens at that step, logits)."""
    runner, records = engine.executor.runner, []
    forward = runner.forward

    def recording(scheduler_output):
        step = forward(scheduler_output)
        for row, request_id in enumerate(step.request_ids):
            records.append((request_id, runner.input_batch.request_token_ids(request_id), step.logits[row].clone()))
        return step

    runner.forward = recording
    return records


def run_to_end(engine, requests: dict[str, tuple[list[int], tuple]], params=GREEDY) -> dict:
    for request_id, (ids, mm_inputs) in requests.items():
        engine.add_request(request_id, ids, params, mm_inputs=mm_inputs)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals
