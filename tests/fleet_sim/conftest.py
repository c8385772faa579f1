"""bench/ is not a package on the test path (importlib mode keeps the repository root off sys.path), so the
simulator is loaded from its directory as the top-level package `fleet_sim`, once, before the tests import it
(its modules import each other relatively, so the name it is loaded under does not matter)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bench" / "fleet_sim"

if "fleet_sim" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("fleet_sim", PACKAGE / "__init__.py",
                                                   submodule_search_locations=[str(PACKAGE)])  # fmt: skip
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["fleet_sim"] = _module
    _spec.loader.exec_module(_module)
