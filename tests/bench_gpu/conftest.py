"""bench/ is not on the test path (importlib mode keeps the repository root off sys.path, and putting the root there
would make its `kernels/` and `operator/` folders importable under PyPI's and the stdlib's names), so the `bench`
package is loaded from its directory, once, under its own name, before the tests import it. (This folder is not
tests/bench: with tests/ on the path, that would be a namespace package `bench` hiding the real one.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bench"

if "bench" not in sys.modules and importlib.util.find_spec("bench") is None:
    _spec = importlib.util.spec_from_file_location("bench", PACKAGE / "__init__.py",
                                                   submodule_search_locations=[str(PACKAGE)])  # fmt: skip
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["bench"] = _module
    _spec.loader.exec_module(_module)
