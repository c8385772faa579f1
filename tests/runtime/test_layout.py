"""The repository layout keeps its promises: nothing shadows stdlib/PyPI modules, the runtime's imports follow
its layers without a cycle, the tiny model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hpi_testing.import_graph import import_cycles, import_graph, layer_of, module_names, upward_imports
from hpi_testing.packaging import dependency_closure

REPO = Path(__file__).resolve().parent.parent.parent
PROJECT_PACKAGES = ("hpi_contracts", "hpi_kernels", "hpi_runtime", "hpi_operator")

# The runtime's layers, lowest first, following one request's data flow (docs/engine.md): a module imports
# from its own layer and the ones below, never from above. A name claims a module and everything under it;
# the longest name that matches decides (so `hpi_runtime.core.interface` sits low while `hpi_runtime.core`
# sits above the worker). A new top-level module falls to the root package's layer, the lowest of the runtime:
# if it imports anything above that, this test fails until the module is placed here.
RUNTIME_LAYERS = (
    ("hpi_contracts",),  # what runtime, router and operator agree on; no dependencies
    ("hpi_kernels",),
    # Plain data and pure helpers every layer speaks: what crosses the process and layer boundaries.
    (
        "hpi_runtime",
        "hpi_runtime.sampling_params",
        "hpi_runtime.outputs",
        "hpi_runtime.structured",
        "hpi_runtime.tools",
        "hpi_runtime.cpu_features",
        "hpi_runtime.gpu_platform",
        "hpi_runtime.embedded",
        "hpi_runtime.core.interface",  # scheduler <-> model runner
        "hpi_runtime.core.engine_io",  # frontend <-> engine core
        "hpi_runtime.core.kv_budget",  # the KV-bytes formula
        "hpi_runtime.options",  # how a config field becomes a flag and an LLM argument
        "hpi_runtime.multimodal.inputs",  # an image as the engine sees it (pixels, placeholders, hash)
    ),
    ("hpi_runtime.attention",),
    # The model on one device: families, weights, quantization, and the engine settings beside them.
    ("hpi_runtime.models", "hpi_runtime.quantization", "hpi_runtime.config", "hpi_runtime.download",
     "hpi_runtime.model_source", "hpi_runtime.host_memory",  # whether the KV cache's host bytes fit
     # LoRA adapters as the model sees them (their checks, registry and slot weights), and a draft model's config:
     # lora.request and lora.slot_table, the names and slot decisions the scheduler passes down, stay plain data.
     "hpi_runtime.lora.peft_dir", "hpi_runtime.lora.registry", "hpi_runtime.lora.layers",
     "hpi_runtime.lora.layout_cache",
     "hpi_runtime.spec_decode.draft_config"),
    ("hpi_runtime.worker", "hpi_runtime.spec_decode.draft_model"),  # model runner, executors; the draft runs there
    ("hpi_runtime.core",),  # scheduler, KV cache manager, engine core and its process
    # input and output processors, AsyncLLM, LLMEngine; images read and processed for a prompt
    ("hpi_runtime.frontend", "hpi_runtime.multimodal"),
    ("hpi_runtime.engine_factory",),  # EngineArgs -> the resolved engine, for the server and LLM
    ("hpi_runtime.server", "hpi_runtime.llm", "hpi_runtime.profiling"),  # the HTTP server, the offline LLM,
    # and `hpi profile`'s measurements
    ("hpi_runtime.cli", "hpi_runtime.serve_contract"),
    ("hpi_runtime.evaluation",),  # measurements over a loaded model: never imported by serving code
)


def _runtime_graph():
    """The imports of the runtime and of the two packages below it (which must not reach up into it)."""
    modules = {}
    for folder, package in (("contracts", "hpi_contracts"), ("kernels", "hpi_kernels"), ("runtime", "hpi_runtime")):
        modules.update(module_names(REPO / folder, package))
    return import_graph(modules, PROJECT_PACKAGES)


def test_component_folders_are_not_packages() -> None:
    for folder in ("operator", "runtime", "kernels"):
        assert not (REPO / folder / "__init__.py").exists(), f"{folder}/__init__.py would shadow a module"


def test_torch_and_stdlib_operator_import_from_repo_root() -> None:
    # `python -c` puts the current directory first on sys.path: a top-level `operator` package would
    # replace the stdlib module and break torch.
    code = "import operator, torch; assert hasattr(operator, 'itemgetter'); print(torch.__version__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("2.13.0")


def test_operator_dependency_closure_has_no_torch() -> None:
    """The operator image installs hpi-operator alone: nothing it requires, directly or transitively, may be
    torch or triton (its import-time check is in tests/operator/test_cli.py)."""
    seen = dependency_closure(["hpi-operator"])
    assert {"kopf", "kubernetes", "aiohttp"} <= seen  # the walk really followed the operator's requirements
    assert not seen & {"torch", "triton"}, "the operator's dependencies pull in torch"


def test_runtime_imports_have_no_cycle() -> None:
    assert import_cycles(_runtime_graph()) == []


def test_runtime_imports_only_downwards() -> None:
    graph = _runtime_graph()
    assert "hpi_runtime.models.decoder" in graph and "hpi_runtime.frontend.async_engine" in graph  # read the tree
    assert upward_imports(graph, RUNTIME_LAYERS) == []


def test_serving_code_never_imports_evaluation() -> None:
    evaluation = layer_of("hpi_runtime.evaluation", RUNTIME_LAYERS)
    importers = {
        module
        for module, imports in _runtime_graph().items()
        if layer_of(module, RUNTIME_LAYERS) != evaluation
        and any(layer_of(i.target, RUNTIME_LAYERS) == evaluation for i in imports)
    }
    assert importers == set()


def _write_tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return module_names(root, "hpi_runtime")


def test_layout_check_catches_an_upward_relative_import(tmp_path: Path) -> None:
    """The checks really fail: a model module reaching up into the worker, and a cycle."""
    modules = _write_tree(tmp_path, {
        "hpi_runtime/__init__.py": "",
        "hpi_runtime/models/__init__.py": "",
        "hpi_runtime/models/llama.py": "from ..worker import x\n\ndef f():\n    from ..worker import executor\n",
        "hpi_runtime/worker/__init__.py": "x = 1\n",
        "hpi_runtime/worker/executor.py": "from hpi_runtime.models.llama import f\n",
    })  # fmt: skip
    graph = import_graph(modules, PROJECT_PACKAGES)
    assert upward_imports(graph, RUNTIME_LAYERS) == [
        "hpi_runtime.models.llama (layer 4) imports hpi_runtime.worker (layer 5), line 1",
        "hpi_runtime.models.llama (layer 4) imports hpi_runtime.worker.executor (layer 5), line 4",
    ]
    assert import_cycles(graph) == [["hpi_runtime.models.llama", "hpi_runtime.worker.executor"]]


def test_layout_check_on_a_synthetic_graph(tmp_path: Path) -> None:
    modules = _write_tree(tmp_path, {
        "hpi_runtime/__init__.py": "",
        "hpi_runtime/core/__init__.py": "",
        "hpi_runtime/core/interface.py": "",
        "hpi_runtime/core/scheduler.py": "from hpi_runtime.core import interface\n",
        "hpi_runtime/worker/__init__.py": "",
        # low data types used by the worker: allowed; a type-only import of the core above: not allowed,
        # but no cycle (it never runs)
        "hpi_runtime/worker/runner.py": (
            "from typing import TYPE_CHECKING\n"
            "from hpi_runtime.core.interface import *\n"
            "if TYPE_CHECKING:\n"
            "    from hpi_runtime.core.scheduler import Scheduler\n"
        ),
        "hpi_runtime/core/engine_core.py": "import hpi_runtime.worker.runner\nimport hpi_operator.plan\n",
        "hpi_runtime/newthing.py": "import hpi_runtime.core.engine_core\n",
        "hpi_runtime/frontend/__init__.py": "",
        "hpi_runtime/frontend/a.py": "from . import b\n",
        "hpi_runtime/frontend/b.py": "from .a import x\n",
    })  # fmt: skip
    graph = import_graph(modules, PROJECT_PACKAGES)
    assert upward_imports(graph, RUNTIME_LAYERS) == [
        "hpi_runtime.core.engine_core imports hpi_operator.plan (line 2), which is in no layer",
        "hpi_runtime.newthing (layer 2) imports hpi_runtime.core.engine_core (layer 6), line 1",
        "hpi_runtime.worker.runner (layer 5) imports hpi_runtime.core.scheduler (layer 6), line 4",
    ]
    assert import_cycles(graph) == [["hpi_runtime.frontend.a", "hpi_runtime.frontend.b"]]


def test_tiny_model_matches_transformers_reload(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello world!"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
