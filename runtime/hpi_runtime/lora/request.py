"""What names an adapter: `LoRARequest` (vLLM's), and the `--lora-modules` values that register adapters at start.

Nothing here imports torch: the config tree parses `--lora-modules` with it, before a model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


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
