"""What every part of the GPU check shares: its context, its record, and the runner that times it and keeps a
failure from stopping the parts after it.

A part is a function `run(ctx) -> dict`. What it could not do it lists under "skipped" (what -> why), so a dry run
on CPU says exactly which measurements need CUDA; an exception fails only that part. The records land in one
file, `<out>/parts.json` (part -> record; parts run one after another, so each rewrites it in turn): the device
tool brings back at most 8 files, and the run's others are the JUnit report, summary.md and the log.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a part measures, not by the summary's process
    import torch


@dataclass(frozen=True)
class PartContext:
    out_dir: Path  # the part's record goes into <out_dir>/parts.json; it writes no other file there (but tests)
    dry_run: bool  # on CPU at toy sizes: every CUDA-only measurement is listed under "skipped" instead
    device: torch.device  # cuda, or cpu in a dry run
    # "embedded", "1b" -> random-weight checkpoint dirs (weights.py); the weights part builds them, later parts get
    # only those that exist.
    models: Mapping[str, Path] = field(default_factory=dict)
    models_root: Path = Path("/tmp/hpi-gpu-models")  # --models: where a part builds a checkpoint of its own (profile)
    kit_dir: Path = Path(".gpu_kit")  # the kit folder that travelled with the checkout (kit.py)
    budget_s: float = 60.0  # the part's share of the script's time (gpu_check.sh); a part sizes its loops to it

    def deadline(self) -> float:
        """perf_counter() value by which the part should stop starting new measurements."""
        return time.perf_counter() + 0.9 * self.budget_s


@dataclass(frozen=True)
class PartRecord:
    part: str
    status: str  # "ran" (possibly with some measurements skipped), "skipped" (all of it) or "failed"
    seconds: float
    results: dict
    skipped: dict[str, str]  # measurement -> why it did not run here
    error: str = ""  # the traceback's tail when status == "failed"

    def summary_line(self) -> str:
        note = f", {len(self.skipped)} skipped" if self.skipped and self.status == "ran" else ""
        reason = f": {self.error.strip().splitlines()[-1]}" if self.error else ""
        if self.status == "skipped":
            reason = f": {'; '.join(self.skipped.values())}"
        return f"{self.part:<8} {self.status:<7} {self.seconds:6.1f} s{note}{reason}"


def run_part(name: str, fn: Callable[[PartContext], dict], ctx: PartContext) -> PartRecord:
    """Run one part, time it, and write its record; a failing part is recorded, not raised."""
    start = time.perf_counter()
    try:
        results = dict(fn(ctx))
        skipped = dict(results.pop("skipped", {}))
        status = "skipped" if not results and skipped else "ran"
        record = PartRecord(name, status, time.perf_counter() - start, results, skipped)
    except Exception:  # a part's failure is its result: the next parts still run
        record = PartRecord(name, "failed", time.perf_counter() - start, {}, {}, traceback.format_exc()[-4000:])
    write_record(ctx.out_dir, record)
    return record


RECORDS = "parts.json"


def write_record(out_dir: Path, record: PartRecord) -> Path:
    """Add (or replace: a rerun with --only) this part's record in <out_dir>/parts.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RECORDS
    records = json.loads(path.read_text()) if path.is_file() else {}
    records[record.part] = record.__dict__
    path.write_text(json.dumps(records, indent=1, default=str) + "\n")
    return path


def read_records(out_dir: Path) -> Mapping[str, PartRecord]:
    path = out_dir / RECORDS
    if not path.is_file():
        return {}
    return {name: PartRecord(**data) for name, data in json.loads(path.read_text()).items()}


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds of `fn`: CUDA events on a GPU (the launches queue; the events time the device), else
    perf_counter."""
    for _ in range(warmup):
        fn()
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1000 * (time.perf_counter() - begin) / iters


def graph_ms(calls: list[Callable[[], object]], replays: int = 3) -> float:
    """GPU milliseconds per call of `calls` (each a closure; a weight per call, say, so that none is read from the
    L2), captured once into a CUDA graph and replayed: the best of `replays`. What a decode step under CUDA graphs
    pays; timing launch by launch instead measures the Python launcher whenever a kernel is shorter (a first run of
    the quantized matmuls here read ~70 us for every small one, whatever its tiles)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: JIT compiles, cuBLAS workspaces
        for fn in calls[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / len(calls))
    return best
