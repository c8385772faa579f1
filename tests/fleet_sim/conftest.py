"""The fleet simulator, loaded from bench/fleet_sim as the top-level package `fleet_sim` before the tests import it
(hpi_testing/package_loader.py says why; its modules import each other relatively, so the name does not matter)."""

from __future__ import annotations

from pathlib import Path

from hpi_testing.package_loader import load_package

load_package("fleet_sim", Path(__file__).resolve().parents[2] / "bench" / "fleet_sim")
