"""Weight loading against the disk's speed (issue 38): the `load` phase of a start (`load_model`: safetensors
memory-mapped, each tensor copied into its parameter) against a plain sequential read of the same file, both from
a cold page cache and from a warm one, on the embedded model (SmolLM2-135M-Instruct, whose checkpoint is fp32).

The page cache is dropped per file with posix_fadvise(POSIX_FADV_DONTNEED), which needs no privilege (the file's
clean pages are evicted; `cold read` shows it worked when it is slower than `warm read`). Alternating rounds; the
median is reported. Loading in bf16 also converts fp32 -> bf16 on the way (what `hpi serve` does here: dtype auto
picks bf16 on AVX512-BF16); fp32 loads as stored.

    HPI_CACHE_DIR=.cache PYTHONPATH=.:contracts:kernels:runtime python -m bench.weight_load
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.fleet_sim.report import machine
from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.embedded import embedded_model_dir
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model, safetensors_files

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 16 << 20


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_seconds(files: list[Path]) -> float:
    buffer = bytearray(CHUNK)
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def load_seconds(model_dir: Path, dtype: torch.dtype) -> float:
    config = load_model_config(model_dir)
    backend = get_attention_backend("torch", dtype, torch.device("cpu"))
    start = time.perf_counter()
    model = load_model(config, dtype, torch.device("cpu"), backend)
    elapsed = time.perf_counter() - start
    del model
    return elapsed


def main(rounds: int = 3) -> None:
    model_dir = embedded_model_dir()
    files = safetensors_files(model_dir)
    num_bytes = sum(f.stat().st_size for f in files)
    runs: dict[str, list[float]] = {}

    def timed(name: str, cold: bool, measure) -> None:
        if cold:
            for f in files:
                evict(f)
        runs.setdefault(name, []).append(measure())

    load_seconds(model_dir, torch.bfloat16)  # first-call costs (imports, allocator) out of the rounds
    for _ in range(rounds):
        timed("cold read", True, lambda: read_seconds(files))
        timed("cold load bf16", True, lambda: load_seconds(model_dir, torch.bfloat16))
        timed("cold load fp32", True, lambda: load_seconds(model_dir, torch.float32))
        timed("warm read", False, lambda: read_seconds(files))
        timed("warm load bf16", False, lambda: load_seconds(model_dir, torch.bfloat16))
        timed("warm load fp32", False, lambda: load_seconds(model_dir, torch.float32))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    speeds = {name: num_bytes / s / 1e6 for name, s in medians.items()}  # MB/s of checkpoint bytes
    out = {
        "machine": machine(), "model": model_dir.name, "checkpoint_bytes": num_bytes, "rounds": rounds,
        "seconds": runs, "median_s": medians, "mb_per_s": {n: round(v, 1) for n, v in speeds.items()},
        "load_over_disk": {dtype: round(speeds[f"cold load {dtype}"] / speeds["cold read"], 3)
                           for dtype in ("bf16", "fp32")},  # fmt: skip
        "target": "cold load >= 50% of the cold sequential read speed",
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_load.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("checkpoint_bytes", "median_s", "mb_per_s", "load_over_disk")}, indent=1))


if __name__ == "__main__":
    main()
