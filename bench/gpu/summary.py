"""The summary part, run last: every part's status, time and headline numbers in `summary.md`, printed too.

A part that left no record (killed at its time limit, or never started) shows as "missing"; the exit status is
non-zero when a part failed or is missing, so the dry run in `make test` fails when any part rots.
"""

from __future__ import annotations

from pathlib import Path

from bench.gpu.part import PartRecord, read_records

REPORT = "summary.md"


def render(records: dict[str, PartRecord], expected: list[str]) -> tuple[str, bool]:
    lines = ["# GPU check", "", "| part | status | seconds | skipped (why) |", "|---|---|---|---|"]
    ok = True
    for name in expected:
        record = records.get(name)
        if record is None:
            lines.append(f"| {name} | missing (killed at its time limit, or never started) | - | - |")
            ok = False
            continue
        ok = ok and record.status != "failed"
        why = "; ".join(f"{what}: {reason}" for what, reason in record.skipped.items()) or "-"
        lines.append(f"| {name} | {record.status} | {record.seconds:.1f} | {why} |")
    for name in expected:
        record = records.get(name)
        if record is None:
            continue
        if record.status == "failed":
            lines += ["", f"## {name}: failed", "", "```", record.error.strip()[-1500:], "```"]
        elif headline := record.results.get("headline"):
            lines += ["", f"## {name}", "", *(f"    {line}" for line in headline)]
    return "\n".join(lines) + "\n", ok


def write_summary(out_dir: Path, expected: list[str]) -> bool:
    text, ok = render(dict(read_records(out_dir)), expected)
    (out_dir / REPORT).write_text(text)
    print(text, end="")
    return ok

