"""One engine's prefill-heavy steps, in process: 32 prompts of 64 random tokens admitted together (one 2,048-token
prefill step) with one output token each, and the same prompts with 32 output tokens (the prefill step, then
decode steps), through the offline `LLM` on the embedded SmolLM2-135M. Printed as JSON: the five prefill-only
runs (ms, sorted) and three mixed runs (output tok/s, sorted). With --profile, the ops and Inductor's own C++
kernels (each one named, `cpp.enable_kernel_profile`) by self CPU time over three prefill-only runs: where a
compiled step's time goes besides its linears and attention. Compare two trees by running this in each,
alternating (bench/results/amx.md, "The residual stream").

    .venv/bin/python -m bench.prefill_step --dtype bfloat16 [--profile]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._inductor.config as inductor_config

from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 32, 64, 32


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--profile", action="store_true", help="also print the top ops and Inductor kernels")
    args = parser.parse_args(argv)
    if args.profile:  # part of the compiled graph's cache key: the graph compiles afresh with it
        inductor_config.cpp.enable_kernel_profile = True
    generator = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        return [torch.randint(100, 40000, (PROMPT_LEN,), generator=generator).tolist() for _ in range(NUM_PROMPTS)]

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    with LLM(dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=2 * NUM_PROMPTS) as llm:
        for _ in range(3):  # warm-up: compiles the step, fills the allocator's pools
            llm.generate(prompts(), one)
        llm.generate(prompts(), many)
        prefill, mixed = [], []
        for _ in range(5):
            start = time.perf_counter()
            llm.generate(prompts(), one)
            prefill.append(round((time.perf_counter() - start) * 1e3, 1))
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompts(), many)
            mixed.append(round(NUM_PROMPTS * OUTPUT_LEN / (time.perf_counter() - start), 1))
        print(json.dumps({"dtype": args.dtype, "prefill_2048_ms": sorted(prefill), "mixed_tok_s": sorted(mixed)}))
        if args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    llm.generate(prompts(), one)
            for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]:
                print(f"{event.self_cpu_time_total / 3e3:9.2f} ms/run {event.count // 3:5d} calls  {event.key[:110]}")


if __name__ == "__main__":
    main()
