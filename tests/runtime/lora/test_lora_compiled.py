"""The compiled model step with LoRA: one graph, compiled at start-up, serves every mix of adapters (the
per-slot token rows are unbacked graph inputs), and with the decode steps in the C++ DecodeStack (each adapted
linear's delta added there), the greedy tokens and logprobs equal transformers + peft for each adapter in a batch
that mixes three adapters and the base model, with adapters swapped through fewer slots than adapters after the
graph was compiled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from hpi_runtime.llm import LLM
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.compiled_model import CompiledForward
from hpi_testing.lora_adapters import greedy, reference_model

pytestmark = pytest.mark.slow  # compiles a 2-layer model (seconds)

PROMPTS = ["The capital of France is", "Hello world! How"]
MAX_TOKENS = 6


def test_one_graph_serves_every_adapter_mix(tiny_model_dir, adapters, monkeypatch):
    # Guards stay evaluated (not sealed), so a step that needed another graph would recompile, which raises.
    monkeypatch.setattr(CompiledForward, "seal", lambda self: None)
    before = counters["stats"]["unique_graphs"]
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
             max_num_seqs=8) as llm:  # fmt: skip
        runner = llm.engine.executor.runner
        assert runner.is_compiled and runner.cpu_decode is not None
        graphs = counters["stats"]["unique_graphs"]
        assert graphs - before == 1
        loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
        cases = [(prompt, name) for prompt in PROMPTS for name in (*loras, None)]
        prompt_ids = [llm.tokenizer(prompt).input_ids for prompt, _ in cases]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
        with torch._dynamo.config.patch(error_on_recompile=True):
            outputs = llm.generate(prompt_ids, params, lora_request=[loras[n] if n else None for _, n in cases])
            single = llm.generate(prompt_ids[:1], params, lora_request=loras["attn"])  # one adapter, one token
        assert counters["stats"]["unique_graphs"] == graphs
        assert runner.cpu_decode.steps >= MAX_TOKENS - 1  # the decode steps ran in the stack (prefills: the graph)
    references = {name: reference_model(tiny_model_dir, adapters[name] if name else None) for name in (*loras, None)}
    for (prompt, name), ids, output in zip(cases, prompt_ids, outputs, strict=True):
        tokens, logprobs = greedy(references[name], ids, MAX_TOKENS)
        assert list(output.output_token_ids) == tokens, (prompt, name)
        assert [e.logprob for e in output.new_logprobs] == pytest.approx(logprobs, abs=1e-4), (prompt, name)
    assert list(single[0].output_token_ids) == greedy(references["attn"], prompt_ids[0], MAX_TOKENS)[0]
    assert len({tuple(o.output_token_ids) for o in outputs}) > len(PROMPTS) * 2  # the adapters really differ
