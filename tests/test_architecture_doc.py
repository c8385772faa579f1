"""docs/architecture.md names real files: every path it quotes exists, so a move or rename elsewhere fails
here instead of leaving the map wrong."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
# Paths in the doc are written from the repository root, or short, from inside the package they belong to.
BASES = (REPO, REPO / "runtime" / "hpi_runtime", REPO / "operator" / "hpi_operator", REPO / "router" / "hpi_router")
QUOTED_PATH = re.compile(r"`([\w./-]+(?:\.py|\.md|\.yaml|\.ini|/))`")
LINK = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)")


def test_every_quoted_path_exists() -> None:
    text = DOC.read_text()
    paths = set(QUOTED_PATH.findall(text))
    assert len(paths) > 40  # the pattern really finds the doc's paths
    missing = sorted(p for p in paths if not any((base / p).exists() for base in BASES))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_linked_doc_exists() -> None:
    links = set(LINK.findall(DOC.read_text()))
    assert links
    missing = sorted(link for link in links if not (DOC.parent / link).exists())
    assert not missing, f"docs/architecture.md links to missing docs: {missing}"


# The design lives in the repository (docs/): no file cites a design document outside it.
CITES_OUTSIDE_DESIGN: set[str] = set()


def test_nothing_cites_a_design_document_outside_the_repository() -> None:
    suffixes = {".py", ".md", ".ini", ".toml", ".yaml", ".txt", ".tpl", ".json"}
    names = {"Makefile", "Dockerfile.runtime", "Dockerfile.operator", "Dockerfile.router"}
    skipped = {".git", ".venv", ".cache", "node_modules", "__pycache__", "results"}  # bench/results: dated reports
    citing = set()
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [d for d in subfolders if d not in skipped and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            if (path.suffix in suffixes or name in names) and "DESIGN.md" in path.read_text(errors="replace"):
                citing.add(str(path.relative_to(REPO)))
    citing.discard("tests/test_architecture_doc.py")
    assert citing == CITES_OUTSIDE_DESIGN, f"cite docs/ instead of DESIGN.md: {sorted(citing - CITES_OUTSIDE_DESIGN)}"
