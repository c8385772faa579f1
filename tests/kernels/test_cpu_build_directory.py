"""Where the C++ CPU kernels build: torch's TORCH_EXTENSIONS_DIR first (the runtime's compile cache sets it),
then $HPI_CACHE_DIR, never a directory that cannot be written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hpi_kernels.cpu._extension import _build_directory

TAG = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"


def test_torch_extensions_dir_comes_first_then_hpi_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "compile"))
    monkeypatch.setenv("HPI_CACHE_DIR", str(tmp_path / "hpi"))
    assert _build_directory("k") == str(tmp_path / "compile" / TAG / "k")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert _build_directory("k") == str(tmp_path / "hpi" / "torch_extensions" / TAG / "k")


def test_an_unusable_directory_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a-file"))  # cannot hold directories
    monkeypatch.setenv("HPI_CACHE_DIR", str(tmp_path / "hpi"))
    assert _build_directory("k") == str(tmp_path / "hpi" / "torch_extensions" / TAG / "k")
    monkeypatch.delenv("HPI_CACHE_DIR")
    assert _build_directory("k") is None  # torch's default
