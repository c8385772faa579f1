"""The embedded checkpoint as converted now (bf16 weights) against the conversion before (the fp32 the Q4_1 GGUF
dequantizes to), served by the same engine in one process: output tokens/s of 1, 8 and 32 requests decoding
`--max-tokens` greedy tokens each (EOS ignored), both LLMs loaded together and timed in alternation, round by
round (the order flipped each round), medians; the weight bytes each engine reports. `--dtype auto` as `hpi
serve` runs it: fp32 on an AVX2-only CPU, where the bf16 checkpoint's linears keep bf16 panels (half the bytes a
decode step reads); on a bf16 CPU both load the same rounded weights. The CPU's ISA is recorded with the results.

    .venv/bin/python -m bench.embedded_dtype [--rounds 3] [--concurrency 1 8 32] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = [f"Write item {i} of a long list about topic {i * 7}." for i in range(64)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from hpi_runtime import cpu_features
    from hpi_runtime.embedded import _convert, ensure_embedded_model, find_gguf_file
    from hpi_runtime.llm import LLM
    from hpi_runtime.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory(prefix="hpi-embedded-fp32-") as scratch:
        fp32_dir = Path(scratch) / "model"
        _convert(find_gguf_file(), fp32_dir, dtype="float32")
        llms = {"fp32 checkpoint (before)": LLM(str(fp32_dir)),
                "bf16 checkpoint (now)": LLM(str(ensure_embedded_model()))}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for llm in llms.values():
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8))
        times: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.concurrency} for name in llms}
        for round_index in range(args.rounds):
            order = list(llms) if round_index % 2 == 0 else list(reversed(llms))
            for concurrency in args.concurrency:
                for name in order:
                    start = time.perf_counter()
                    llms[name].generate(PROMPTS[:concurrency], params)
                    times[name][concurrency].append(concurrency * args.max_tokens / (time.perf_counter() - start))
            print(f"round {round_index + 1}: " + "; ".join(
                f"N={c}: " + ", ".join(f"{n} {times[n][c][-1]:.1f}" for n in llms) for c in args.concurrency),
                flush=True)  # fmt: skip
        weights = {name: llm.bundle.footprint.weight_bytes for name, llm in llms.items()}
        dtype = str(llms[list(llms)[1]].bundle.resolved.executor_config.dtype)
    before, now = list(llms)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_capability":
                    torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                    "flags": sorted(f for f in cpu_features.cpu_flags() if f.startswith(("avx", "amx", "fma")))},
        "dtype_auto": dtype,
        "max_tokens": args.max_tokens,
        "tok_s": times,
        "weight_bytes": weights,
    }  # fmt: skip
    print(f"{'N':>4} {before:>26} {now:>26} {'now / before':>13}")
    for c in args.concurrency:
        b, n = statistics.median(times[before][c]), statistics.median(times[now][c])
        print(f"{c:>4} {b:>26.1f} {n:>26.1f} {n / b:>13.2f}")
    print("weights: " + ", ".join(f"{name} {b / 2**20:.0f} MiB" for name, b in weights.items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
