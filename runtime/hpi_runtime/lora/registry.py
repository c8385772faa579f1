"""The adapters a frontend serves, by name: the one place that checks an adapter before the engine sees it.

Loading an adapter (at start-up from --lora-modules, at run time through POST /v1/load_lora_adapter, or the
first time `LLM.generate` meets a `LoRARequest`) reads its directory's config and safetensors header against
the base model (peft_dir.py): a bad directory is a ValueError and changes nothing that is loaded. A loaded
adapter gets a `lora_int_id` never used before in this process, so reloading a name after an unload starts
new prefix-cache keys. Requests carry their `LoRARequest` to the engine core, so unloading only stops new
requests: those already queued or running finish with the adapter they started with.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hpi_runtime.lora.peft_dir import read_adapter
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.models.config import ModelConfig


class LoRAAlreadyLoadedError(ValueError):
    pass


class LoRARegistry:
    def __init__(self, model_config: ModelConfig, max_lora_rank: int) -> None:
        self.model_config, self.max_lora_rank = model_config, max_lora_rank
        self._by_name: dict[str, LoRARequest] = {}  # in load order
        self._checked: dict[int, str] = {}  # lora_int_id -> the path checked for it
        self._ids = itertools.count(1)

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the directory and register it under `name`; ValueError (LoRAAlreadyLoadedError for a name in
        use) leaves the registry as it was."""
        if name in self._by_name:
            raise LoRAAlreadyLoadedError(f"The lora adapter '{name}' has already been loaded.")
        read_adapter(path, self.model_config, self.max_lora_rank)
        lora = LoRARequest(name, self._new_id(), str(path), base_model_name)
        self._checked[lora.lora_int_id] = lora.lora_path
        self._by_name[name] = lora
        return lora

    def unload(self, name: str) -> LoRARequest:
        """Stop serving `name` to new requests; KeyError if it is not loaded."""
        return self._by_name.pop(name)

    def check(self, lora: LoRARequest) -> LoRARequest:
        """A caller's own LoRARequest (LLM.generate's lora_request): its directory checked once per id."""
        path = self._checked.get(lora.lora_int_id)
        if path is None:
            read_adapter(lora.lora_path, self.model_config, self.max_lora_rank)
            self._checked[lora.lora_int_id] = lora.lora_path
        elif path != lora.lora_path:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already used by the adapter at {path!r}")
        return lora

    def _new_id(self) -> int:
        while (lora_id := next(self._ids)) in self._checked:
            pass
        return lora_id
