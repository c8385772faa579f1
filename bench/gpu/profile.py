"""GPU check, part `profile`: `hpi profile` of Llama-3.1-8B's shape on the GPU, the figures the fleet optimizer
reads for an H200 pool (spec.placement.pools[].performance), measured instead of assumed.

The part writes random bf16 weights in Llama-3.1-8B-Instruct's exact shape (weights.EIGHT_B_SHAPE: 8.03B
parameters, 16 GB; drawn on the GPU, saved once under the models folder) and runs the real command line,
`python -m hpi_runtime.cli profile`, on them: the decode step time at batch 1 to 256 with 1,024 tokens of context
per sequence (fitted as ITL = alpha + beta x batch), the prefill throughput at 512 and 2048 prompt tokens, and
the sequences a 36 GiB KV cache holds at 1,024 tokens each (capped at 256). The first run (2026-12-04) timed
decode at 26 tokens of context, as `hpi profile` then did. Its JSON goes into the record as it is;
bench/fleet_sim/pools.py (MEASURED_H200) takes it from there, beside the roofline estimate
(hpi_operator.fleet.assumed), which this machine's Python cannot import (no kopf here).

Dry run (CPU): the embedded shape cut to 2 layers (the weights part's checkpoint), fp32, eager, batch 1 and 2 and
one short prompt: it checks the command line and the record, not any speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gpu.part import PartContext
from bench.gpu.weights import build_random_model, parameter_count, tokenizer_dir


@dataclass(frozen=True)
class ProfilePlan:
    """What the part measures; the defaults are the GPU plan, a dry run replaces them."""

    shape: str = "8b"
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    prompt_lengths: tuple[int, ...] = (512, 2048)
    context_tokens: int = 1024
    steps: int = 16
    # 36 GiB is 294,912 tokens of the 8B's KV (128 KiB a token): the largest batch, 256 sequences of 1,024 tokens of
    # context (decode is timed at it), with room; the default (85% of the free memory) would only raise maxNumSeqs.
    engine_args: tuple[str, ...] = ("--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", "256",
                                    "--max-model-len", "4096", "--kv-cache-memory", "36GiB")  # fmt: skip


def plan_for(ctx: PartContext) -> ProfilePlan:
    if not ctx.dry_run:
        return ProfilePlan()
    return ProfilePlan(shape="embedded", batch_sizes=(1, 2), prompt_lengths=(16,), context_tokens=64, steps=2,
                       engine_args=("--device", "cpu", "--dtype", "float32", "--enforce-eager", "--max-num-seqs",
                                    "2", "--max-model-len", "128"))  # fmt: skip


def profile_command(model_dir: Path, plan: ProfilePlan, output: Path) -> list[str]:
    return [
        sys.executable, "-m", "hpi_runtime.cli", "profile", "--model", str(model_dir), *plan.engine_args,
        "--batch-sizes", ",".join(map(str, plan.batch_sizes)),
        "--prompt-lengths", ",".join(map(str, plan.prompt_lengths)),
        "--context-tokens", str(plan.context_tokens), "--steps", str(plan.steps), "--output", str(output),
    ]  # fmt: skip


def headline(shape: str, profile: dict) -> list[str]:
    points = ", ".join(f"b{b} {ms:.2f}" for b, ms in profile["decodePoints"])
    prefill = ", ".join(f"{n} tokens {tps:,.0f}/s" for n, tps in profile["prefillPoints"])
    return [
        f"{shape}: ITL = {profile['itlAlphaMs']:.2f} + {profile['itlBetaMs']:.4f} x batch ms; "
        f"prefill {profile['prefillTokensPerSecond']:,.0f} tokens/s; {profile['maxNumSeqs']} sequences of "
        f"{profile['contextTokens']} tokens",
        f"decode ms per step: {points}",
        f"prefill: {prefill}",
    ]


def run(ctx: PartContext) -> dict:
    plan = plan_for(ctx)
    skipped = {}
    if ctx.dry_run:
        skipped["8b"] = "the 8B shape (16 GB in bf16) is built and profiled only on a GPU machine"
        model_dir = ctx.models.get("embedded")
        if model_dir is None:
            return {"skipped": {"models": "no embedded checkpoint under --models: run the weights part first"}}
        build_s = 0.0
    else:
        model_dir = ctx.models_root / plan.shape
        start = time.perf_counter()
        build_random_model(plan.shape, model_dir, tokenizer_dir(ctx.kit_dir), ctx.device)
        build_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "profile.json"
        start = time.perf_counter()
        remaining = max(ctx.budget_s - build_s, 10.0)
        done = subprocess.run(profile_command(model_dir, plan, output), capture_output=True, text=True,
                              timeout=remaining, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"hpi profile exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        profile = json.loads(output.read_text())
        profile_s = time.perf_counter() - start
    shape = plan.shape if not ctx.dry_run else "embedded (2 layers, dry run)"
    return {
        "shape": shape,
        "parameters": parameter_count(plan.shape) if not ctx.dry_run else None,
        "command": " ".join(profile_command(Path("<model>"), plan, Path("<out>"))[1:]),
        "build_s": round(build_s, 1),
        "profile_s": round(profile_s, 1),
        "profile": profile,
        "headline": headline(shape, profile),
        "skipped": skipped,
    }
