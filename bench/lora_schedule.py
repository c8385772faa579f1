"""The LoRA scheduler's packing of the served benchmark's load, without the machine's noise: bench_lora's closed
loop (32 clients, 160 requests of 64 prompt and 32 output tokens spread evenly over 8 adapters, `--max-loras 4`)
replayed on the real engine (`LLMEngine`: scheduler, slot table, KV cache manager) with the model replaced by a
step-time model. Each policy serves the same requests; what differs is how many rows each decode step runs and
how many steps the load takes, which the served benchmark can only see through run-to-run noise of +-15%.

Step-time model (ms): `alpha + beta x decode rows + gamma x prefill tokens`, defaults from bench_lora's in-process
step times on the embedded model (AMD EPYC, 2 cores, bf16: 16 rows 16.0 ms, 32 rows 28.9 ms) and its prefill
(0.58 ms a prompt token at 374-token chunks); the answer's modeled throughput is only as good as that model, the
step and row counts are exact. A client sends its next request when its last one finishes (at the next step).
A prefetched adapter is reported read one step after it was asked for (the served read takes 4 ms from the layout
cache, less than a step).

    .venv/bin/python -m bench.lora_schedule --patience 0 2 1000000
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from unittest import mock

from hpi_runtime.config import EngineConfig
from hpi_runtime.core import scheduler as scheduler_module
from hpi_runtime.core.interface import ModelRunnerOutput, SchedulerOutput
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepModel:
    alpha_ms: float = 3.1
    beta_ms: float = 0.806  # a decode row
    gamma_ms: float = 0.58  # a prefill token

    def step_ms(self, decode_rows: int, prefill_tokens: int) -> float:
        return self.alpha_ms + self.beta_ms * decode_rows + self.gamma_ms * prefill_tokens


@dataclass
class ModeledExecutor:
    """Stands in for the model runner: one token for each request whose known tokens are all computed, and each
    step's rows and time recorded. Prefetched adapters are ready at the end of the step that asked for them."""

    num_kv_blocks: int
    block_size: int
    model: StepModel
    read_steps: int = 1  # a prefetched adapter is reported read this many steps after it was asked for
    num_host_kv_blocks: int = 0
    reads: list[tuple[int, int]] = field(default_factory=list)  # (step it is reported in, lora_int_id)
    states: dict[str, list[int]] = field(default_factory=dict)  # request id -> [known tokens, computed tokens]
    steps: list[tuple[int, int]] = field(default_factory=list)  # (decode rows, prefill tokens) per step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert not so.preempted_request_ids, "the replay sizes the KV cache so that nothing is preempted"
        for request_id in so.finished_request_ids:
            self.states.pop(request_id, None)
        for new in so.new_requests:
            self.states[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        sampled, decode_rows, prefill_tokens = {}, 0, 0
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.states[request_id]
            decoding = state[0] - state[1] == 1 and num_tokens == 1 and state[1] > 0
            decode_rows += decoding
            prefill_tokens += 0 if decoding else num_tokens
            state[1] += num_tokens
            if state[1] == state[0]:
                sampled[request_id] = (7,)
                state[0] += 1
                state[1] = state[0] - 1
        self.steps.append((decode_rows, prefill_tokens))
        step = len(self.steps)
        self.reads += [(step + self.read_steps - 1, lora.lora_int_id) for lora in so.lora_updates.prefetches]
        ready = tuple(lora_id for at, lora_id in self.reads if at <= step)
        self.reads = [(at, lora_id) for at, lora_id in self.reads if at > step]
        return ModelRunnerOutput(sampled_token_ids=sampled, lora_ready=ready)

    def stage_busy_s(self) -> tuple[float, ...]:
        return ()

    def register_failure_callback(self, callback) -> None:
        pass

    def sleep(self, level: int) -> int:
        raise ValueError("the modeled executor does not sleep")

    def wake_up(self) -> int:
        raise ValueError("the modeled executor does not sleep")

    def shutdown(self) -> None:
        pass


def replay(patience: int, *, num_requests: int = 160, concurrency: int = 32, num_adapters: int = 8, max_loras: int = 4,
           prompt_len: int = 64, output_len: int = 32, model: StepModel = StepModel(), max_cpu_loras: int | None = None,
           read_steps: int = 1) -> dict:  # fmt: skip
    """One closed-loop run with LORA_DRAIN_PATIENCE = `patience` (0: drain at once; huge: never); host memory
    keeps `max_cpu_loras` adapters (default: max_loras, as the server), a read takes `read_steps` steps."""
    config = EngineConfig(block_size=16, max_model_len=2048, max_loras=max_loras,
                          max_cpu_loras=max_cpu_loras or max_loras)  # fmt: skip
    executor = ModeledExecutor(4096, config.block_size, model, read_steps)
    engine = LLMEngine(config, executor, None, frozenset())
    loras = [LoRARequest(f"adapter{i}", i + 1, f"/adapters/adapter{i}") for i in range(num_adapters)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sent, step_of = 0, {}  # request id -> (step sent, step of its first token)

    def send() -> None:
        nonlocal sent
        prompt = [(sent * 7919 + j) % 30000 + 1 for j in range(prompt_len)]  # distinct: no prefix-cache hits
        engine.add_request(f"r{sent}", prompt, params, lora_request=loras[sent % num_adapters])
        step_of[f"r{sent}"] = [len(executor.steps), None]
        sent += 1

    with mock.patch.object(scheduler_module, "LORA_DRAIN_PATIENCE", patience):
        for _ in range(min(concurrency, num_requests)):
            send()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if step_of[output.request_id][1] is None:
                    step_of[output.request_id][1] = len(executor.steps)
                if output.finished and sent < num_requests:
                    send()
    decode = [rows for rows, prefill in executor.steps if rows and not prefill]
    time_s = sum(model.step_ms(rows, prefill) for rows, prefill in executor.steps) / 1e3
    waits = sorted(first - sent_at for sent_at, first in step_of.values())
    return {"patience": patience, "max_cpu_loras": config.max_cpu_loras, "read_steps": read_steps,
            "steps": len(executor.steps), "decode_only_steps": len(decode),
            "mean_decode_rows": round(statistics.fmean(decode), 2),
            "prefill_steps": sum(1 for _, prefill in executor.steps if prefill),
            "mean_rows": round(statistics.fmean(rows + (prefill > 0) for rows, prefill in executor.steps), 2),
            "steps_to_first_token_mean": round(statistics.fmean(waits), 1),
            "steps_to_first_token_p90": waits[int(0.9 * len(waits))], "steps_to_first_token_max": waits[-1],
            "modeled_s": round(time_s, 3), "modeled_output_tok_s": round(num_requests * output_len / time_s, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patience", type=int, nargs="+", default=[0, 2, 10**9])
    parser.add_argument("--num-requests", type=int, default=160)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-cpu-loras", type=int, nargs="+", default=[4])
    parser.add_argument("--read-steps", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = [replay(p, num_requests=args.num_requests, output_len=args.output_len, max_cpu_loras=cpu,
                      read_steps=args.read_steps)
               for cpu in args.max_cpu_loras for p in args.patience]  # fmt: skip
    for result in results:
        print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"what": "bench.lora_schedule", "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
