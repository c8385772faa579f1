"""bench/gpu_check.sh's dry run, as `make test` runs it on CPU: every part runs or says why it skipped, the results
fit what the device tool brings back, `--only` reruns one part, and a rotten part fails the run.

The script runs for real (bash, the parts as subprocesses of the suite's Python); only CUDA is absent, which is
what the dry run is for. What only a GPU can show is listed by the parts themselves under "skipped".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "gpu_check.sh"
PARTS = ("env", "weights", "tests", "step", "kernels", "serve", "kv_tier", "profile")
# What the device tool brings back from $OUT: at most 8 files, named in letters, digits, '.', '_' and '-'.
MAX_FILES = 8


def _run(out: Path, *args: str, models: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    if models is not None:
        env["HPI_GPU_MODELS"] = str(models)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _records(out: Path) -> dict:
    return json.loads((out / "parts.json").read_text())


def test_dry_run_runs_every_part_fits_the_device_tool_and_reruns_one_part(tmp_path: Path) -> None:
    """One test, not several sharing a module fixture: under pytest-xdist each worker would run the fixture's dry
    run (about a minute) again."""
    out, models = tmp_path / "out", tmp_path / "models"
    finished = _run(out, "--dry-run", models=models)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-2000:]

    # Every part ran, or said why not; on CPU every CUDA-only measurement is named as skipped, with its reason.
    records = _records(out)
    assert set(records) == set(PARTS)
    for name, record in records.items():
        assert record["status"] in ("ran", "skipped"), f"{name}: {record['error'][-2000:]}"
        assert all(reason.strip() for reason in record["skipped"].values()), name
    assert "gpu" in records["env"]["skipped"]
    assert "1b" in records["weights"]["skipped"]
    for name in ("step", "kernels", "kv_tier"):
        assert records[name]["skipped"], f"{name} skipped nothing on CPU: it cannot have measured CUDA"
    served = records["serve"]["results"]["models"]["embedded"]  # hpi serve and transformers on CPU, toy sizes
    for clients in ("1", "2"):
        measured = served["hpi"]["clients"][clients]
        assert measured["num_errors"] == 0, measured["errors"]
        assert measured["output_tok_s"] > 0 and measured["ttft_p50_ms"] > 0 and measured["itl_p50_ms"] > 0
        assert served["transformers"]["batches"][clients]["output_tok_s"] > 0
        assert served["ratios"][clients]["hpi_over_tf"] > 0
    assert "8b" in records["profile"]["skipped"]  # the dry run profiles the 2-layer embedded shape instead
    profile = records["profile"]["results"]["profile"]  # `hpi profile`'s own JSON, through its command line
    # Two noisy points on a loaded CI machine can fit a zero intercept: the line, not alpha alone, must be positive.
    assert profile["itlAlphaMs"] >= 0 and profile["itlBetaMs"] >= 0
    assert profile["itlAlphaMs"] + profile["itlBetaMs"] > 0 and [b for b, _ in profile["decodePoints"]] == [1, 2]
    assert records["tests"]["results"]["counts"].get("skipped", 0) > 0
    assert not records["tests"]["results"]["failures"]
    summary = (out / "summary.md").read_text()
    assert all(f"| {name} |" in summary for name in PARTS)
    assert summary in finished.stdout  # printed last

    # What comes back from $OUT: at most 8 files, plainly named.
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= MAX_FILES, sorted(p.name for p in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", path.name) for path in files)
    assert {"parts.json", "junit.xml", "summary.md", "log.txt"} <= {path.name for path in files}

    # --only reruns the named part (after env) and keeps the others' records.
    rerun = _run(out, "--dry-run", "--only", "kv_tier", models=models)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    after = _records(out)
    assert after.keys() == records.keys()
    assert after["weights"] == records["weights"] and after["serve"] == records["serve"]
    assert after["kv_tier"] != records["kv_tier"] or after["env"] != records["env"]
    assert "parts env kv_tier" in rerun.stdout


def test_unknown_part_is_refused_before_anything_runs(tmp_path: Path) -> None:
    finished = _run(tmp_path, "--dry-run", "--only", "stepp")
    assert finished.returncode == 2
    assert "unknown part 'stepp'" in finished.stdout
    assert not (tmp_path / "parts.json").exists()


def test_a_failed_or_missing_part_fails_the_summary(tmp_path: Path) -> None:
    record = {"part": "env", "status": "ran", "seconds": 1.0, "results": {}, "skipped": {}, "error": ""}
    failed = {**record, "part": "step", "status": "failed", "error": "Traceback ...\nRuntimeError: boom"}
    (tmp_path / "parts.json").write_text(json.dumps({"env": record, "step": failed}))
    command = [sys.executable, "-m", "bench.gpu", "summary", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    finished = subprocess.run([*command, "--parts", "env,step,serve"], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert finished.returncode == 1
    assert "| serve | missing" in finished.stdout and "RuntimeError: boom" in finished.stdout
    assert subprocess.run([*command, "--parts", "env"], cwd=REPO_ROOT, env=env, timeout=120).returncode == 0
