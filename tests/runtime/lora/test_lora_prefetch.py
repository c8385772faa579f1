"""An adapter that host memory no longer holds is read in a background thread while the running batch goes on:
its request waits (the step loop never reads from disk while something runs), is admitted once the read is
reported, and then gets the same tokens as transformers + peft. A read that fails fails its request only, and
the adapter is read again for the next one."""

from __future__ import annotations

import shutil
import threading

import pytest

from hpi_runtime.core.engine_core import EngineError
from hpi_runtime.llm import LLM
from hpi_runtime.lora.layers import LoRAModel
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.sampling_params import SamplingParams
from hpi_testing.lora_adapters import reference_greedy

MAX_TOKENS = 6


def test_an_evicted_adapter_is_read_off_the_step_thread(tiny_model_dir, adapters, monkeypatch):
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    short = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8, dtype="float32",
             enforce_eager=True, max_num_seqs=8) as llm:  # fmt: skip
        prompt = llm.tokenizer("The capital of France is").input_ids
        # "all", then "attn", then "mlp": two slots and two host copies, so "all" is evicted from host memory.
        for name in ("all", "attn", "mlp"):
            llm.generate([prompt], short, lora_request=loras[name])
        engine = llm.engine
        assert engine.get_stats().lora_host_evictions >= 1

        started, released, reads = threading.Event(), threading.Event(), []
        read = LoRAModel.read

        def gated_read(self, lora):
            reads.append((lora.lora_name, threading.current_thread().name))
            started.set()
            assert released.wait(timeout=30), "the test never released the read"
            return read(self, lora)

        monkeypatch.setattr(LoRAModel, "read", gated_read)
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request("busy", prompt, long, lora_request=loras["mlp"])  # in a slot already: no read
        engine.step()
        engine.add_request("evicted", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           lora_request=loras["all"])  # fmt: skip
        scheduler = engine.scheduler
        busy, evicted = scheduler.requests["busy"], scheduler.requests["evicted"]
        generated = len(busy.output_token_ids)
        for _ in range(3):  # the read is held: the busy request runs on, the evicted one waits
            engine.step()
        assert started.wait(timeout=30), "the adapter was never read"  # the background thread may start late
        assert reads == [("all", reads[0][1])] and reads[0][1].startswith("lora-prefetch")
        assert len(busy.output_token_ids) == generated + 3
        assert evicted.lora_slot is None and "all" in engine.get_stats().lora_waiting

        released.set()
        engine.executor.lora.host[loras["all"].lora_int_id].result()
        outputs = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
        assert len(reads) == 1  # the slot load was a copy of what the background thread read
    expected, _ = reference_greedy(tiny_model_dir, adapters["all"], prompt, MAX_TOKENS)
    assert list(outputs["evicted"].output_token_ids) == expected


def test_a_failed_read_fails_its_request_and_is_retried_later(tiny_model_dir, adapters, tmp_path):
    directory = shutil.copytree(adapters["attn"], tmp_path / "attn")
    lora = LoRARequest("attn", 1, str(directory))
    weights = directory / "adapter_model.safetensors"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32",
             enforce_eager=True, max_num_seqs=4) as llm:  # fmt: skip
        prompt = llm.tokenizer("Hello world! How").input_ids
        engine = llm.engine
        held = weights.rename(tmp_path / "held.safetensors")  # gone after the adapter was registered
        engine.add_request("first", prompt, params, lora_request=lora)
        with pytest.raises(EngineError, match="first"):
            while engine.has_unfinished_requests():
                engine.step()
        held.rename(weights)
        engine.add_request("again", prompt, params, lora_request=lora)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    expected, _ = reference_greedy(tiny_model_dir, adapters["attn"], prompt, MAX_TOKENS)
    assert list(outputs["again"].output_token_ids) == expected
