"""`python -m hpi_kernels.cpu.prebuild --lower`, which `make test` starts in the background: it builds (here, after
the suite's own builds, it finds up to date) this CPU's kernels and each lower capability's, the very extensions the
kernel tests' child processes load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpi_kernels.cpu._extension import cpu_capability, lower_capabilities


def test_lower_capabilities_are_the_builds_this_cpu_also_runs() -> None:
    assert lower_capabilities("AVX512") == ["AVX2", "DEFAULT"]
    assert lower_capabilities("AVX2") == ["DEFAULT"]
    assert lower_capabilities("DEFAULT") == []


@pytest.mark.slow
def test_prebuild_builds_every_capability_this_cpu_runs() -> None:
    command = [sys.executable, "-m", "hpi_kernels.cpu.prebuild", "--lower"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    expected = [cpu_capability(), *lower_capabilities(cpu_capability())]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == expected
    for capability, line in zip(expected, lines, strict=True):
        library = Path(line.split(": ", 1)[1])
        assert library.is_file() and library.name == f"hpi_cpu_kernels_{capability.lower()}.so"
