"""hpi_kernels imports without Triton or a GPU; its launchers load on first use."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import hpi_kernels
from hpi_kernels.cpu._extension import _SOURCES


def test_quant_and_reference_do_not_import_triton() -> None:
    code = (
        "import sys, hpi_kernels, hpi_kernels.quant, hpi_kernels.reference; "
        "hpi_kernels.quantize_int4; "
        "assert 'triton' not in sys.modules, 'importing hpi_kernels pulled in triton'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_public_api_resolves() -> None:
    for name in hpi_kernels.__all__:
        assert callable(getattr(hpi_kernels, name))
    with pytest.raises(AttributeError):
        hpi_kernels.no_such_kernel  # noqa: B018


def test_the_cpp_sources_and_every_header_they_include_ship_in_the_package() -> None:
    """The C++ kernels compile on the user's machine from the installed package (a plain `pip install ./kernels`,
    as Dockerfile.runtime does): each source and every local header it includes must match the package data."""
    package = Path(hpi_kernels.__file__).parent / "cpu"
    pyproject = tomllib.loads((package.parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["hpi_kernels.cpu"]
    headers = {h for source in _SOURCES for h in re.findall(r'#include "([^"]+)"', source.read_text())}
    assert "packed_linear.h" in headers  # the pattern finds the includes
    shipped = {p.name for p in package.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)}
    missing = sorted(({s.name for s in _SOURCES} | headers) - shipped)
    assert not missing, f"kernels/pyproject.toml's package-data leaves out {missing}"
