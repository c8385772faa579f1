"""Quantization benchmark: weight memory, tokens/s and perplexity of none / int8 / int4 on the embedded model.

For each method (and dtype) the embedded SmolLM2-135M-Instruct is loaded through `LLM(quantization=...)`;
weight bytes are what the engine reports (`hpi:model_weight_bytes`); tokens/s is generated tokens over
wall time for N concurrent short prompts (~6 tokens) decoding `--max-tokens` greedy tokens each (EOS
ignored), all variants loaded at once and timed in alternation (median of `--rounds`); perplexity is over
the fixed text the tests ship (tests/runtime/quantization/data/ppl_text.txt), once in one prefill (the linears'
long-prefill path) and once in chunks of 64 tokens (the kernels decode steps run: what int4's int8 activations
change shows there only). Ratios are against
`none` at the same dtype, and ("x best") against the faster unquantized dtype at that concurrency (the
baseline a user would pick on this machine), same machine, same run. int4 variants are named by scheme
(`int4-g<group>-<fit>-<policy>[-a8]`): `--int4-schemes minmax-uniform mse-mixed` compares the min/max rounding
of before issue 17 with the MSE fit and the mixed-precision policy; `mse-mixed-float mse-mixed-int8` int4 with
float and with int8 activations (W4A8, `--int4-activations`); `--int8-activations float int8` the int8 variant
with float and with int8 activations (W8A8). The answer column is the greedy answer to the bare "What is the
capital of France?", whose first token is a near-tie in this model (0.14 nat between "The" and "L" in bf16);
the agreement columns count, over 40 short chat prompts, the greedy answers (16 tokens) whose first token and
whose 16 tokens equal the first variant's (the fp32 model where --dtypes starts with float32), and the KL
divergence each variant's next-token distributions over the text (64-token chunks) add to the first's. The CPU's bf16
ISA is recorded with the results.

    .venv/bin/python bench/bench_quantization.py                           # fp32, N = 1 and 32
    .venv/bin/python bench/bench_quantization.py --dtypes float32 bfloat16 --group-sizes 32 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hpi_kernels.cpu import int4_a8_tile, int8_a8_tile
from hpi_runtime.evaluation.perplexity import kl_divergence, next_token_logprobs, perplexity
from hpi_runtime.llm import LLM
from hpi_runtime.quantization.quantize import DEFAULT_INT4_GROUP_SIZE
from hpi_runtime.sampling_params import SamplingParams

TEXT_PATH = Path(__file__).resolve().parent.parent / "tests/runtime/quantization/data/ppl_text.txt"
PERPLEXITY_CHUNK = 64  # tokens per chunk of the second perplexity: decode-sized row counts for the linears
PROMPTS = ["The capital of France is", "Once upon a time, there", "The best way to learn is", "Rivers flow"]
_TOPICS = ("the moon", "photosynthesis", "the French revolution", "prime numbers", "volcanoes", "the internet",
           "coffee", "black holes", "the Roman empire", "DNA", "rainbows", "jazz", "chess", "penguins", "gravity",
           "the Eiffel Tower", "electricity", "honey bees", "the Pacific Ocean", "Shakespeare")  # fmt: skip
AGREEMENT_CHATS = [[{"role": "user", "content": f"Tell me one fact about {topic}."}] for topic in _TOPICS] + [
    [{"role": "user", "content": f"What is {a} plus {a + 4}?"}] for a in range(3, 23)]  # fmt: skip
AGREEMENT_TOKENS = 16


@dataclass(frozen=True)
class Result:
    dtype: str
    method: str
    group_size: int | None
    scheme: str  # e.g. int4-g32-mse-mixed (QuantizationConfig.scheme)
    quantized_lm_head: bool
    lm_head_w8a8: bool  # the int8 head took x in int8 (its leading logits recomputed from float x)
    weight_bytes: int
    load_s: float
    tokens_per_s: dict[int, float]  # concurrency -> generated tokens/s (median over rounds)
    perplexity: float  # one prefill of the text: linears over the long-prefill path
    perplexity_chunked: float  # the text in chunks of PERPLEXITY_CHUNK tokens: linears over decode's kernels
    answer: str
    # Of the AGREEMENT_CHATS' greedy answers, how many have the first variant's first token / all its tokens
    agrees_first: int
    agrees_all: int
    # Over the text in PERPLEXITY_CHUNK-token chunks: the mean KL divergence (nats) this variant's next-token
    # distributions add to the first variant's, and how often its most likely next token is the first's
    kl_vs_first: float
    top1_vs_first: float


@dataclass(frozen=True)
class Variant:
    dtype: str
    method: str
    group_size: int
    int4_fit: str = "mse"
    int4_policy: str = "mixed"
    int4_activations: str = "auto"  # "auto" | "int8" (W4A8) | "float"
    int8_activations: str = "auto"  # --quantization int8's linears: "auto" | "int8" (W8A8) | "float"
    quantize_lm_head: bool = False  # int8/int4: the LM head too (a tied head becomes int8, shared with the embeddings)
    lm_head_activations: str = "auto"  # an int8 head: "auto" | "int8" (W8A8, leaders recomputed) | "float"


def cpu_isa() -> str:
    """The CPU's bf16 support as the runtime sees it: amx_bf16 / avx512_bf16 / none (emulated)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), "none (bf16 emulated)")


def _load(variant: Variant) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(None, dtype=variant.dtype, quantization=variant.method, quantization_group_size=variant.group_size,
              int4_fit=variant.int4_fit, int4_policy=variant.int4_policy,
              int4_activations=variant.int4_activations, int8_activations=variant.int8_activations,
              lm_head_activations=variant.lm_head_activations,
              kv_cache_memory_bytes=256 << 20,
              max_model_len=1024, quantize_lm_head=variant.quantize_lm_head and variant.method != "none")  # fmt: skip
    return llm, time.perf_counter() - start


def _tokens_per_s(llm: LLM, concurrency: int, max_tokens: int) -> float:
    # Short plain prompts (~6 tokens): at 32 requests the step time is decode, not prefill.
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.output_token_ids) for o in outputs) / (time.perf_counter() - start)


def measure_all(variants: list[Variant], concurrency: list[int], max_tokens: int, rounds: int) -> list[Result]:
    """Load every variant, then time them in alternation, round after round: load from other processes on
    the machine drifts, and alternating spreads that drift over all variants instead of biasing one."""
    loaded = [_load(v) for v in variants]
    for llm, _ in loaded:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    samples: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        for n in concurrency:
            for i, (llm, _) in enumerate(loaded):
                samples.setdefault((i, n), []).append(_tokens_per_s(llm, n, max_tokens))
    results = []
    ids = loaded[0][0].tokenizer.encode(TEXT_PATH.read_text())
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    reference: list[list[int]] = []
    reference_logprobs: torch.Tensor | None = None
    for i, (variant, (llm, load_s)) in enumerate(zip(variants, loaded, strict=True)):
        answer = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16))[0].text
        greedy = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
        answers = [list(o.output_token_ids) for o in llm.chat(AGREEMENT_CHATS, greedy)]
        reference = reference or answers
        agrees_first = sum(a[0] == r[0] for a, r in zip(answers, reference, strict=True))
        agrees_all = sum(a == r for a, r in zip(answers, reference, strict=True))
        # Last: perplexity() gives the model a private KV cache, so the engine must be done with it.
        executor = llm.engine.executor
        ppl = perplexity(executor.model, executor.runner.backend, ids)
        logprobs = next_token_logprobs(executor.model, executor.runner.backend, ids, PERPLEXITY_CHUNK)
        ppl_chunked = math.exp(-logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())
        reference_logprobs = logprobs if reference_logprobs is None else reference_logprobs
        kl = kl_divergence(reference_logprobs, logprobs)
        top1 = (reference_logprobs.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
        tokens_per_s = {n: statistics.median(samples[(i, n)]) for n in concurrency}
        results.append(Result(variant.dtype, variant.method, variant.group_size if variant.method == "int4" else None,
                              llm.bundle.resolved.quantization_scheme,
                              variant.quantize_lm_head and variant.method != "none",
                              bool(getattr(llm.engine.executor.model.lm_head, "int8_activations", False)),
                              llm.bundle.footprint.weight_bytes,
                              load_s,
                              tokens_per_s, ppl, ppl_chunked, answer, agrees_first, agrees_all, kl, top1))  # fmt: skip
        llm.shutdown()
        print(json.dumps(asdict(results[-1])), flush=True)
    return results


def table(results: list[Result], concurrency: list[int]) -> str:
    head = ["dtype", "quantization", "weights (MiB)", "x none"]
    for n in concurrency:
        head += [f"tok/s @{n}", "x none", "x best"]
    head += ["perplexity", "x none", f"perplexity, {PERPLEXITY_CHUNK}-token chunks", "x none",
             "answer to 'capital of France?'", f"agrees with {results[0].dtype} {results[0].scheme}: 1st token",
             f"all {AGREEMENT_TOKENS}", "KL to it (nats)", "same top-1"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {r.dtype: r for r in results if r.method == "none"}
    best = {n: max((r.tokens_per_s[n] for r in base.values()), default=None) for n in concurrency}
    for r in results:
        b = base.get(r.dtype, r)
        name = r.scheme + (f" + int8 head{' (W8A8)' if r.lm_head_w8a8 else ''}" if r.quantized_lm_head else "")
        row = [r.dtype, name, f"{r.weight_bytes / 2**20:.1f}", f"{r.weight_bytes / b.weight_bytes:.2f}"]
        for n in concurrency:
            best_n = best[n] or r.tokens_per_s[n]
            row += [f"{r.tokens_per_s[n]:.1f}", f"{r.tokens_per_s[n] / b.tokens_per_s[n]:.2f}",
                    f"{r.tokens_per_s[n] / best_n:.2f}"]  # fmt: skip
        row += [f"{r.perplexity:.2f}", f"{r.perplexity / b.perplexity:.3f}", f"{r.perplexity_chunked:.2f}",
                f"{r.perplexity_chunked / b.perplexity_chunked:.3f}", r.answer.replace("|", "/"),
                f"{r.agrees_first}/{len(AGREEMENT_CHATS)}", f"{r.agrees_all}/{len(AGREEMENT_CHATS)}",
                f"{r.kl_vs_first:.4f}", f"{r.top1_vs_first:.1%}"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--methods", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--quantized-dtypes", nargs="+", default=None,
                        help="dtypes the int8/int4 variants run in (default: --dtypes)")  # fmt: skip
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[DEFAULT_INT4_GROUP_SIZE],
                        help="int4 group sizes to try")
    parser.add_argument("--int4-schemes", nargs="+", default=["mse-mixed"],
                        help="int4 <fit>-<policy>[-<activations>] to try, e.g. minmax-uniform mse-mixed "
                             "mse-mixed-int8 mse-mixed-float (activations: hpi serve --int4-activations)")
    parser.add_argument("--int8-activations", nargs="+", default=["auto"], choices=["auto", "int8", "float"],
                        help="the int8 and int4 variants once per value (hpi serve --int8-activations: int8 is "
                             "W8A8, for int4 on the int8 layers its policy keeps)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="int8/int4 variants quantize the LM head too (hpi serve --quantize-lm-head)")
    parser.add_argument("--lm-head-activations", nargs="+", default=["auto"], choices=["auto", "int8", "float"],
                        help="with --quantize-lm-head, the int8/int4 variants once per value (hpi serve "
                             "--lm-head-activations: int8 is W8A8 with the leading logits recomputed)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="alternating timing rounds; the median is kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU bf16: {cpu_isa()}, "
          f"load average {os.getloadavg()[0]:.1f} (the machine may be shared)", flush=True)  # fmt: skip
    load_before = os.getloadavg()[0]
    variants = [
        Variant(dtype, method, group_size, *scheme.split("-"), int8_activations=int8_activations,
                quantize_lm_head=args.quantize_lm_head, lm_head_activations=head)  # fmt: skip
        for dtype in args.dtypes
        for method in args.methods
        if method == "none" or dtype in (args.quantized_dtypes or args.dtypes)
        for group_size in (args.group_sizes if method == "int4" else args.group_sizes[:1])
        for scheme in (args.int4_schemes if method == "int4" else ["mse-mixed"])
        for int8_activations in (args.int8_activations if method in ("int8", "int4") else ["auto"])
        for head in (args.lm_head_activations if method != "none" and args.quantize_lm_head else ["auto"])
    ]
    results = measure_all(variants, args.concurrency, args.max_tokens, args.rounds)
    print(table(results, args.concurrency))
    print(f"load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f}")
    if args.json:
        payload = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_bf16": cpu_isa(),
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "int4_a8_tile": int4_a8_tile(),
                   "int8_a8_tile": int8_a8_tile(),
                   "load_average": [load_before, os.getloadavg()[0]],
                   "results": [asdict(r) for r in results]}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
