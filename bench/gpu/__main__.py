"""`python -m bench.gpu PART --out DIR [--dry-run]`: run one part of the GPU check (bench/gpu_check.sh runs them in
order, each under its time budget) and record it in DIR/PART.json; `summary --parts a,b,...` writes summary.md."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from bench.gpu import summary
from bench.gpu.part import PartContext, run_part

# part -> module with `run(ctx) -> dict`; imported when the part runs, so that its import error fails that part only.
PARTS = {
    "env": "bench.gpu.env",
    "weights": "bench.gpu.weights",
    "tests": "bench.gpu.gpu_tests",
    "step": "bench.gpu.step",
    "kernels": "bench.gpu.kernels",
    "serve": "bench.gpu.serve",
    "kv_tier": "bench.gpu.kv_tier",
    "profile": "bench.gpu.profile",
}


NEEDS_MODELS = ("step", "serve")  # they measure the weights part's checkpoints (profile builds its own on a GPU)


def _part(name: str):
    def run(ctx: PartContext) -> dict:
        if name in NEEDS_MODELS and not ctx.models:
            return {"skipped": {"models": "no checkpoint under --models: run the weights part first"}}
        return importlib.import_module(PARTS[name]).run(ctx)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("part", choices=[*PARTS, "summary"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="on CPU at toy sizes; CUDA-only measurements skip")
    parser.add_argument("--budget", type=float, default=60.0, help="the part's seconds (gpu_check.sh sets them)")
    parser.add_argument("--models", type=Path, default=Path("/tmp/hpi-gpu-models"), help="random-weight checkpoints")
    parser.add_argument("--kit", type=Path, default=Path(".gpu_kit"), help="the kit folder (python -m bench.gpu.kit)")
    parser.add_argument("--parts", default=",".join(PARTS), help="summary: the parts that should have run")
    args = parser.parse_args()
    if args.part == "summary":
        return 0 if summary.write_summary(args.out, args.parts.split(",")) else 1
    import torch  # not for the summary: it reads records

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run")
    device = torch.device("cpu" if args.dry_run else "cuda")
    models = {shape: args.models / shape for shape in ("embedded", "1b")}  # the weights part says why 1b is not built
    if args.part != "weights":  # later parts get the checkpoints that exist
        models = {shape: path for shape, path in models.items() if (path / "config.json").is_file()}
    ctx = PartContext(args.out, args.dry_run, device, models, args.models, args.kit, args.budget)
    record = run_part(args.part, _part(args.part), ctx)
    print(record.summary_line(), flush=True)
    return 1 if record.status == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
