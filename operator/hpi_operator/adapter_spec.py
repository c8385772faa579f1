"""spec.adapters: LoRA adapters served on the base model, parsed (syntax only; spec.py checks them against the
model and its volumes, adapters.py turns them into Jobs, a ConfigMap and calls on the pods)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REVISION = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_./]*")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: served as `name`, from a Hugging Face repo (downloaded onto the model cache) or a directory
    already on the model's volume (`path`, relative to its root)."""

    name: str
    hf_id: str | None = None
    hf_revision: str = "main"
    path: str | None = None
    pools: tuple[str, ...] = ()  # empty: every pool

    @property
    def source(self) -> str:
        return f"huggingface:{self.hf_id}@{self.hf_revision}" if self.hf_id else f"path:{self.path}"

    def serves_on(self, pool: str) -> bool:
        return not self.pools or pool in self.pools


def _adapter(raw: Any, at: str) -> AdapterSpec:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{at} must be an object with name and source; got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{at}.name must be 1-128 letters, digits, '.', '_' or '-' (not first); got {name!r}")
    source = raw.get("source") or {}
    hf, path = source.get("huggingface"), source.get("path")
    if (hf is None) == (path is None):
        raise ValueError(f"{at}.source needs exactly one of huggingface and path; got {dict(source)!r}")
    pools = raw.get("pools") or []
    if not isinstance(pools, list) or not all(isinstance(p, str) and p for p in pools):
        raise ValueError(f"{at}.pools must be a list of pool names; got {pools!r}")
    if hf is not None:
        hf_id, revision = hf.get("id"), str(hf.get("revision") or "main")
        if not isinstance(hf_id, str) or not re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+", hf_id):
            raise ValueError(f"{at}.source.huggingface.id must be a repository id like org/name; got {hf_id!r}")
        if not REVISION.fullmatch(revision) or ".." in revision.split("/"):
            raise ValueError(f"{at}.source.huggingface.revision must be a branch, tag or commit; got {revision!r}")
        return AdapterSpec(name, hf_id=hf_id, hf_revision=revision, pools=tuple(pools))
    clean = str(path).strip("/")
    if not isinstance(path, str) or not clean or ".." in clean.split("/"):
        raise ValueError(f"{at}.source.path must be a directory inside the volume; got {path!r}")
    return AdapterSpec(name, path=clean, pools=tuple(pools))


def parse_adapters(raw: Sequence[Any] | None) -> tuple[AdapterSpec, ...]:
    """spec.adapters -> AdapterSpecs; ValueError naming the field for what the schema cannot catch."""
    if not raw:
        return ()
    if not isinstance(raw, list):
        raise ValueError(f"spec.adapters must be a list; got {raw!r}")
    adapters = tuple(_adapter(item, f"spec.adapters[{i}]") for i, item in enumerate(raw))
    seen: set[str] = set()
    for adapter in adapters:
        if adapter.name in seen:
            raise ValueError(f"spec.adapters: the name {adapter.name!r} is given twice")
        seen.add(adapter.name)
    return adapters
