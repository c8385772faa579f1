"""The repository layout keeps its promises: nothing shadows stdlib/PyPI modules, the tiny model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


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
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = ["hpi-operator"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:  # an optional dependency of some package, not installed here
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    assert {"kopf", "kubernetes", "aiohttp"} <= seen  # the walk really followed the operator's requirements
    assert not seen & {"torch", "triton"}, "the operator's dependencies pull in torch"


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
