"""The `bench` package, loaded from its folder for the GPU kit's tests (hpi_testing/package_loader.py says why).
This folder is not tests/bench: with tests/ on the path, that would be a namespace package `bench` hiding the real
one."""

from __future__ import annotations

from pathlib import Path

from hpi_testing.package_loader import load_package

load_package("bench", Path(__file__).resolve().parents[2] / "bench")
