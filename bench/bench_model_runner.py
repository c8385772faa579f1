"""Model-runner benchmark: generated tokens/s of the engine on the embedded model against transformers.

For each dtype and each concurrency N, N prompts decode `--max-tokens` greedy tokens (EOS ignored, so
every request produces the same count) through `LLM.generate` (continuous batching, paged KV cache,
torch attention backend) and through transformers' `generate` on the same prompts as one static,
left-padded batch. Prints tokens/s for both and their ratio, for each engine mode: `compiled` (the
default, torch.compile of the model step at start-up) and `eager` (`enforce_eager=True`); the start-up
column is the time `LLM(...)` took (load + compile + warm-up).

    .venv/bin/python bench/bench_model_runner.py                       # full: N = 1 8 32 64, fp32 + bf16
    .venv/bin/python bench/bench_model_runner.py --concurrency 1 8 --max-tokens 16 --dtypes float32
    .venv/bin/python bench/bench_model_runner.py --modes eager          # also an engine without the flag
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List five prime numbers.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a Kubernetes operator do?",
]


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    return [
        list(llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]


def _ours(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.output_token_ids) == max_tokens for o in outputs)
    return len(prompts) * max_tokens / elapsed


def _transformers(model, pad_id: int, prompts: list[list[int]], max_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == max_tokens
    return len(prompts) * max_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    print(f"{'dtype':<9} {'mode':<8} {'start-up s':>10} {'N':>3} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}")
    has_flag = "enforce_eager" in inspect.signature(LLM).parameters  # engines from before the flag: eager
    for dtype in args.dtypes:
        hf_model, hf_tok_s = None, {}
        for mode in args.modes:
            flag = {"enforce_eager": mode == "eager"} if has_flag else {}
            start = time.perf_counter()
            llm = LLM(args.model, dtype=dtype, device=args.device, max_model_len=1024,
                      max_num_seqs=max(args.concurrency), **flag)  # fmt: skip
            startup_s = time.perf_counter() - start
            if hf_model is None:
                model_dir = llm.bundle.resolved.model_dir
                hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
                hf_model = hf_model.to(args.device).eval()
                _transformers(hf_model, llm.tokenizer.pad_token_id or 0, _prompts(llm, 2), 4)  # warm-up
            pad_id = llm.tokenizer.pad_token_id or 0
            _ours(llm, _prompts(llm, 2), 4)  # warm-up
            for n in args.concurrency:
                prompts = _prompts(llm, n)
                ours = _ours(llm, prompts, args.max_tokens)
                if n not in hf_tok_s:  # transformers does not change with our mode
                    hf_tok_s[n] = _transformers(hf_model, pad_id, prompts, args.max_tokens)
                theirs = hf_tok_s[n]
                print(f"{dtype:<9} {mode:<8} {startup_s:>10.1f} {n:>3} {ours:>11.1f} {theirs:>9.1f} "
                      f"{ours / theirs:>6.2f}", flush=True)  # fmt: skip
            llm.shutdown()
            del llm
        del hf_model


if __name__ == "__main__":
    main()
