"""What names an adapter: `LoRARequest` (vLLM's), and the `--lora-modules` values that register adapters at start.

Nothing here imports torch: the config tree parses `--lora-modules` with it, before a model loads.

`--lora-modules @PATH` reads the list from a file: a JSON list of vLLM's objects (`{"name", "path",
"base_model_name"}`), as the operator writes each pool's adapters into a mounted ConfigMap (docs/lora.md): a pod
that starts loads what the spec lists then, and later changes reach running pods through the admin endpoints. A
missing file lists nothing (the ConfigMap is optional: a pod may start before the operator wrote it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    """One loaded adapter, as vLLM names it: `lora_int_id` (>= 1) is unique for the life of the engine, so a
    name unloaded and loaded again gets a new id (and new prefix-cache keys: its weights may differ)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1 (0 is the base model), got {self.lora_int_id}")


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` value: an adapter to load at start-up."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError if neither."""
    text = text.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: not valid JSON: {text!r} ({exc})") from None
        unknown = set(fields) - {"name", "path", "base_model_name"}
        if not isinstance(fields.get("name"), str) or not isinstance(fields.get("path"), str) or unknown:
            raise ValueError(f'--lora-modules: JSON needs string "name" and "path" (and optional "base_model_name"); '
                             f"got {text!r}")  # fmt: skip
        module = LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
        module = LoRAModulePath(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"--lora-modules: the name and the path must not be empty, got {text!r}")
    return module


def _file_modules(path: str) -> list[LoRAModulePath]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        logger.info("--lora-modules @%s: no such file yet, no adapter to load at start", path)
        return []
    except OSError as exc:
        raise ValueError(f"--lora-modules @{path}: cannot read it: {exc}") from None
    if not text.strip():
        return []
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--lora-modules @{path}: not valid JSON ({exc})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--lora-modules @{path}: expected a JSON list of objects, got {text[:200]!r}")
    return [parse_lora_module(json.dumps(entry)) for entry in entries]


def lora_modules(values: Iterable[str]) -> tuple[LoRAModulePath, ...]:
    """--lora-modules values -> the adapters they name: `name=path`, a JSON object, or `@PATH` (a file's list)."""
    modules: list[LoRAModulePath] = []
    for text in values:
        text = text.strip()
        if text.startswith("@"):
            if len(text) == 1:
                raise ValueError("--lora-modules @PATH needs a path after the @")
            modules += _file_modules(text[1:])
        else:
            modules.append(parse_lora_module(text))
    return tuple(modules)
