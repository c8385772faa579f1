"""Load a package from a folder that is not on the test path, under a name of its choosing, once.

bench/ is not on the test path: importlib mode keeps the repository root off sys.path, since putting it there
would make its `kernels/` and `operator/` folders importable under PyPI's and the stdlib's names. The tests of
bench/ code (tests/fleet_sim, tests/bench_gpu) load what they need from its folder with this.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_package(name: str, folder: Path) -> None:
    """Import `folder` as the package `name` (its modules import each other by that name or relatively), unless it
    is imported already or importable as itself (the repository root on PYTHONPATH). A test folder of that name
    (tests/fleet_sim, a namespace package on the test path) does not count."""
    if name in sys.modules:
        return
    found = importlib.util.find_spec(name)
    if found is not None and found.submodule_search_locations and folder.resolve() in {
        Path(location).resolve() for location in found.submodule_search_locations
    }:
        return
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])  # fmt: skip
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
