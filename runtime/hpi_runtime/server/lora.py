"""Loading and unloading LoRA adapters at run time, with vLLM's endpoints and switch.

`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} checks the PEFT directory against the base model and
serves it under that name (400 naming the problem otherwise: nothing loaded changes); `POST
/v1/unload_lora_adapter` {"lora_name"} stops serving it (404 for a name not loaded). Requests already queued or
running for an unloaded adapter finish with it. As in vLLM the two routes exist only when the environment says
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (or 1); otherwise they are 404. They sit under /v1/, behind --api-key.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from hpi_runtime.lora.registry import LoRAAlreadyLoadedError
from hpi_runtime.server.errors import ApiError, bad_request
from hpi_runtime.server.request_io import read_json
from hpi_runtime.server.state import STATE_KEY, ServedModel, ServerState

RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def runtime_lora_updating_allowed(environ: Mapping[str, str]) -> bool:
    return environ.get(RUNTIME_LORA_UPDATING_ENV, "").strip().lower() in ("1", "true")


def _string_field(body: object, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' must be a non-empty string", name)
    return value


def _registry(model: ServedModel):
    if model.loras is None:
        raise bad_request("this server serves no LoRA adapters: start it with --enable-lora")
    return model.loras


async def load_lora_adapter(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await read_json(request)
    name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
    model = state.admit()
    registry = _registry(model)
    if name == model.name:
        raise bad_request(f"'{name}' is the base model's name", "lora_name")
    try:
        # On the loop, not in a thread: the check reads two small files (a JSON and a safetensors header), and
        # two loads of one name must not both pass the name check.
        registry.load(name, path)
    except LoRAAlreadyLoadedError as exc:
        raise bad_request(str(exc), "lora_name") from None
    except ValueError as exc:
        raise bad_request(f"cannot load LoRA adapter '{name}': {exc}", "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    name = _string_field(await read_json(request), "lora_name")
    registry = _registry(state.admit())
    try:
        registry.unload(name)
    except KeyError:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found") from None  # fmt: skip
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post(LOAD_PATH, load_lora_adapter)
    app.router.add_post(UNLOAD_PATH, unload_lora_adapter)
