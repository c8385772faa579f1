"""hpi_kernels imports without Triton or a GPU; its launchers load on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hpi_kernels


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
