"""The tests part: every `gpu`-marked test, stopping at the first failure (-x), each under a time limit, with a
JUnit XML report. Under the kit (HPI_GPU_KIT=1) the tests that need the embedded model's real weights skip
themselves and say why (tests/runtime/conftest.py): its GGUF does not travel.

Only the files that hold `gpu` tests are collected: the rest of the suite imports what the GPU machine lacks (the
operator's, the router's and the fuzzers' packages). In a dry run the same command runs on CPU, where every one
of them skips ("needs a CUDA device"), which still proves the files collect and the report is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from bench.gpu.part import PartContext

REPO_ROOT = Path(__file__).resolve().parents[2]
PER_TEST_TIMEOUT_S = 90
REPORT = "junit.xml"


def gpu_test_files(root: Path = REPO_ROOT / "tests") -> list[str]:
    return sorted(str(path.relative_to(REPO_ROOT)) for path in root.rglob("test_*.py")
                  if "pytest.mark.gpu" in path.read_text())  # fmt: skip


def read_junit(path: Path) -> dict:
    """Counts, each failure's test and message head, and the skip reasons with how many tests gave each."""
    tree = ET.parse(path)
    counts = Counter()
    failures, skips = [], Counter()
    for case in tree.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            skips[(outcome.get("message") or "").removeprefix("Skipped: ")[:200]] += 1
        else:
            counts["failed"] += 1
            failures.append({"test": name, "message": (outcome.get("message") or "")[:500]})
    return {"counts": dict(counts), "failures": failures, "skip_reasons": dict(skips)}


def run(ctx: PartContext) -> dict:
    files = gpu_test_files()
    report = ctx.out_dir / REPORT
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", f"--timeout={PER_TEST_TIMEOUT_S}", "-q",
               "-p", "no:cacheprovider", f"--junitxml={report}", *files]  # fmt: skip
    env = {**os.environ, "HPI_GPU_KIT": "1"}
    finished = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=max(30.0, ctx.budget_s))  # fmt: skip
    if not report.is_file():
        raise RuntimeError(f"pytest wrote no report (exit {finished.returncode}):\n{finished.stdout[-3000:]}"
                           f"{finished.stderr[-2000:]}")  # fmt: skip
    results = {"files": files, "exit_code": finished.returncode, **read_junit(report)}
    counts = results["counts"]
    results["headline"] = [f"gpu tests: {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
                           f"{counts.get('skipped', 0)} skipped (exit {finished.returncode})"]  # fmt: skip
    results["headline"] += [f"  FAILED {f['test']}: {f['message'][:160]}" for f in results["failures"]]
    if finished.returncode not in (0, 5) and not results["failures"]:  # 5: nothing selected
        raise RuntimeError(f"pytest exited {finished.returncode}:\n{finished.stdout[-3000:]}")
    return results
