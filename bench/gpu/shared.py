"""Small helpers the GPU check's measurement parts share (step, serve): which model goes first, and how a failure
that cost one model or mode its numbers is noted without losing the others'."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

PAST_DEADLINE = "cut: the part's time budget ran out"


def embedded_first(models: Mapping[str, Path]) -> list[tuple[str, Path]]:
    """The models in the order to measure them: the embedded shape first, so the deadline cuts the larger one."""
    return sorted(models.items(), key=lambda item: item[0] != "embedded")


def failure_note(exc: BaseException) -> str:
    """A skipped entry's reason for a measurement that raised: its first line."""
    return f"failed: {(str(exc).strip() or type(exc).__name__).splitlines()[0][:200]}"


def failure_record(exc: BaseException) -> dict:
    """What stands in the results where a failed measurement's numbers would."""
    return {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
