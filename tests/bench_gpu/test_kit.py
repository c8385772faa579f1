"""The GPU kit's wheels (bench/gpu/kit.py): everything the GPU path imports is on the GPU machine or in the kit.

The GPU machine has no package index, so a new third-party import in the runtime, the kernels, the kit's parts or
the `gpu` tests that is neither in its image nor among the kit's wheels would break the next GPU run, minutes into
a scarce lease. This check reads the imports statically, so it costs nothing here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_kit():
    spec = importlib.util.spec_from_file_location("gpu_kit_manifest", REPO_ROOT / "bench" / "gpu" / "kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(paths: list[Path]) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and not n.startswith(("hpi_", "bench"))}


def _gpu_path_sources() -> list[Path]:
    roots = ["runtime/hpi_runtime", "kernels/hpi_kernels", "contracts/hpi_contracts", "bench/gpu"]
    sources = [p for root in roots for p in (REPO_ROOT / root).rglob("*.py")]
    gpu_tests = [p for p in (REPO_ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()]
    # The conftest files pytest loads for those tests (each folder's up to tests/), and the helpers they use.
    conftests = {folder / "conftest.py" for test in gpu_tests for folder in test.parents
                 if folder.is_relative_to(REPO_ROOT / "tests")}  # fmt: skip
    helpers = [REPO_ROOT / "tests" / "hpi_testing" / "tiny_model.py", REPO_ROOT / "bench" / "loadgen.py",
               REPO_ROOT / "bench" / "systems.py", REPO_ROOT / "bench" / "serving.py",
               REPO_ROOT / "bench" / "step_driver.py"]  # fmt: skip
    return sources + gpu_tests + [p for p in [*conftests, *helpers] if p.is_file()]


def test_every_import_of_the_gpu_path_is_on_the_machine_or_in_the_kit() -> None:
    kit = _load_kit()
    available = {_normalise(n) for n in kit.MACHINE_PACKAGES}
    available |= {_normalise(spec.split("==")[0]) for spec in kit.KIT_WHEELS}
    distributions = importlib.metadata.packages_distributions()  # import name -> distributions, from this venv
    missing = {}
    for module in sorted(_imports(_gpu_path_sources())):
        dists = {_normalise(d) for d in distributions.get(module, [module])}
        if not dists & available:
            missing[module] = sorted(dists)
    assert not missing, f"imported on the GPU path but neither on the GPU machine nor in KIT_WHEELS: {missing}"


def test_kit_wheels_are_pinned_once_each() -> None:
    kit = _load_kit()
    names = [_normalise(spec.split("==")[0]) for spec in kit.KIT_WHEELS]
    assert all("==" in spec for spec in kit.KIT_WHEELS)
    assert len(names) == len(set(names))  # two versions of one package stop the whole install there
    assert not set(names) & {_normalise(n) for n in kit.MACHINE_PACKAGES} - {"typing-extensions"}
