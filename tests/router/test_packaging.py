"""The router is its own package: it imports without torch or the runtime, and nothing it requires pulls
them in (its image installs router/ and contracts/ alone, Dockerfile.router)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from hpi_testing.packaging import dependency_closure

REPO = Path(__file__).resolve().parent.parent.parent


def test_component_folder_is_not_a_package() -> None:
    # Like operator/, runtime/ and kernels/: only router/hpi_router is importable (docs/architecture.md).
    assert not (REPO / "router" / "__init__.py").exists()


def test_router_imports_without_torch_or_the_runtime() -> None:
    code = ("import sys, hpi_router.cli, hpi_router.discovery; "
            "print(sorted(m for m in ('torch', 'hpi_runtime', 'hpi_kernels', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing hpi_router loaded {result.stdout.strip()}"


def test_router_dependency_closure_has_no_torch() -> None:
    """Walk the requirements of router/pyproject.toml through the installed distributions' metadata."""
    project = tomllib.loads((REPO / "router" / "pyproject.toml").read_text())["project"]
    seen = dependency_closure(Requirement(line).name for line in project["dependencies"])
    assert {"aiohttp", "kubernetes", "hpi-contracts"} <= seen
    assert not seen & {"torch", "triton", "hpi-runtime", "hpi-kernels"}, "the router's dependencies pull in torch"


def test_console_script_points_at_the_cli_main() -> None:
    project = tomllib.loads((REPO / "router" / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"hpi-router": "hpi_router.cli:main"}
