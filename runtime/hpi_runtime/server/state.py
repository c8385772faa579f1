"""The server's own state: the loaded model (once ready), lifecycle phase and in-flight accounting."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hpi_contracts.pool_profile import PoolProfile
from hpi_runtime.config import ServerConfig
from hpi_runtime.lora.registry import LoRARegistry
from hpi_runtime.server.errors import ApiError
from hpi_runtime.server.metrics import ServingMetrics
from hpi_runtime.server.profile_file import PoolProfileFile


@dataclass(frozen=True)
class ServedModel:
    """What the endpoints need of the loaded model; set once loading and warm-up are done."""

    engine: Any  # AsyncLLM
    tokenizer: Any
    name: str
    max_model_len: int
    vocab_size: int
    # generation_config.json's temperature/top_p/top_k/min_p/repetition_penalty: used where a request is silent
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    loras: LoRARegistry | None = None  # the LoRA adapters served beside the base model (--enable-lora)
    images: Any = None  # server/images.ImageSupport of a vision-language model; None: text only


@dataclass(frozen=True)
class ServerSettings:
    """config.ServerConfig resolved for serving: the name fixed, the API key read, the origins split. Its
    defaults are ServerConfig's (tests build it directly)."""

    served_model_name: str
    api_key: str | None = None
    max_request_body_bytes: int = ServerConfig.max_request_body_bytes
    drain_timeout_s: float = ServerConfig.drain_timeout_s
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral: enables tool_choice "auto"
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from ("*": any); empty: no CORS
    pool_profile: PoolProfile | None = None  # exported as hpi:profile_* gauges (the router's speed prior)
    pool_profile_path: str | None = None  # --pool-profile @PATH: the profile from this file, re-read on change
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist
    allow_runtime_lora_updating: bool = False


class ServerState:
    """Lifecycle: loading -> ready (<-> asleep) -> draining. Owned by one server; stored on the aiohttp app."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.metrics = ServingMetrics(settings.served_model_name)
        self._profile_file = PoolProfileFile(settings.pool_profile_path) if settings.pool_profile_path else None
        if settings.pool_profile is not None:
            self.metrics.set_pool_profile(settings.pool_profile)
        self.refresh_pool_profile()
        self.model: ServedModel | None = None
        self.draining = False
        self.load_error: str | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def refresh_pool_profile(self) -> None:
        """With --pool-profile @PATH: export the file's profile if it changed (before each /metrics answer)."""
        if self._profile_file is not None and self._profile_file.check():
            self.metrics.set_pool_profile(self._profile_file.profile)

    @property
    def ready(self) -> bool:
        return self.model is not None and not self.draining and not self._engine_dead() and not self.sleeping

    @property
    def sleeping(self) -> bool:
        """Sleep mode (server/sleep.py): the engine keeps no KV cache (nor, at level 2, weights) until woken."""
        return self.model is not None and bool(getattr(self.model.engine, "is_sleeping", False))

    def _engine_dead(self) -> bool:
        return self.model is not None and bool(getattr(self.model.engine, "errored", False))

    def set_model(self, model: ServedModel) -> None:
        self.model = model
        self.metrics.set_ready(self.ready)

    def begin_drain(self) -> None:
        self.draining = True
        self.metrics.set_ready(False)

    def admit(self) -> ServedModel:
        """The model for a new request, or a 503 while loading, draining, asleep or after an engine failure."""
        model = self.loaded_model()
        if self.sleeping:
            raise ApiError(503, "this replica is asleep (POST /wake_up wakes it); retry on another replica",
                           code="sleeping")
        return model

    def loaded_model(self) -> ServedModel:
        """The model, asleep or not (for sleep and wake), or a 503 while loading, draining or after a failure."""
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica", code="draining")
        if self.model is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, message, code="not_ready")
        if self._engine_dead():
            raise ApiError(503, "the engine has failed; this replica is restarting", code="engine_dead")
        return self.model

    def request_started(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return False


STATE_KEY = web.AppKey("hpi_state", ServerState)
