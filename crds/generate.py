"""Writes the copies of the CRDs in this folder (the source of truth) into the places that ship them:
the Helm chart's crds/ (Helm installs them before the templates) and the operator package's crds/
(crd_defaults.py reads the schema's defaults from it, so the operator image carries it). Each copy is the
source's bytes behind a header that names the source; edit the source, never a copy.

    python3 crds/generate.py          # rewrite the copies (`make crds`)
    python3 crds/generate.py --check  # exit 1 naming each stale or stray copy (tests/chart/test_crds.py)

Standard library only, so it runs before any virtualenv exists. kubectl ignores this file: `kubectl apply
-f crds/` reads only .yaml, .yml and .json files.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIR = "crds"
COPY_DIRS = ("charts/hetero-paged-infer/crds", "operator/hpi_operator/crds")


def header(name: str) -> bytes:
    return f"# Generated from {SOURCE_DIR}/{name} by `make crds`: edit the source, not this copy.\n".encode()


def expected_copies(repo: Path = REPO) -> dict[Path, bytes]:
    """Every copy's path -> the bytes it must hold."""
    sources = sorted((repo / SOURCE_DIR).glob("*.yaml"))
    return {repo / folder / src.name: header(src.name) + src.read_bytes() for folder in COPY_DIRS for src in sources}


def stale_copies(repo: Path = REPO) -> list[str]:
    """Copies that are missing or differ from their source, and YAML files in a copy folder with no source."""
    expected = expected_copies(repo)
    problems = [f"{path.relative_to(repo)} is stale" for path, data in expected.items()
                if not path.is_file() or path.read_bytes() != data]  # fmt: skip
    for folder in COPY_DIRS:
        problems += [f"{path.relative_to(repo)} has no source in {SOURCE_DIR}/"
                     for path in sorted((repo / folder).glob("*.yaml")) if path not in expected]  # fmt: skip
    return problems


def write_copies(repo: Path = REPO) -> None:
    for path, data in expected_copies(repo).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for folder in COPY_DIRS:  # a CRD removed from the source leaves the copies too
        for path in (repo / folder).glob("*.yaml"):
            if not (repo / SOURCE_DIR / path.name).is_file():
                path.unlink()


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        problems = stale_copies()
        for problem in problems:
            print(f"{problem}: run `make crds`", file=sys.stderr)
        return 1 if problems else 0
    if argv:
        print("usage: python3 crds/generate.py [--check]", file=sys.stderr)
        return 2
    write_copies()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
