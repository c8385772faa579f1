"""The `bench` package, loaded from its folder for the tests of the suite's ratios and report (see
hpi_testing/package_loader.py; this folder is not tests/bench, which would be a namespace package hiding it)."""

from __future__ import annotations

from pathlib import Path

from hpi_testing.package_loader import load_package

load_package("bench", Path(__file__).resolve().parents[2] / "bench")
