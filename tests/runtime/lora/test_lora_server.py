"""LoRA over HTTP: a real `hpi serve --enable-lora` subprocess and the real openai client.

Adapters are named by the request's 'model'; GET /v1/models lists them with their parent; POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, behind the API
key) change them while requests are in flight, and no request is lost; a json_schema request for an adapter
keeps both its grammar and its adapter; a bad adapter is a 400 that changes nothing loaded; an unknown model
is a 404 naming what is served; the metrics name the adapters.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from hpi_runtime.server.lora import LOAD_PATH, UNLOAD_PATH, runtime_lora_updating_allowed
from hpi_testing.lora_adapters import build_adapter, reference_greedy
from hpi_testing.server import RuntimeServer

BASE = "tiny-llama"
KEY = "lora-test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-server")
    log = folder / "server.log"
    # "attn" comes from a file, as the operator's ConfigMap lists a pool's adapters (--lora-modules @PATH).
    listing = folder / "lora-modules.json"
    listing.write_text(json.dumps([{"name": "attn", "path": str(adapters["attn"]), "base_model_name": BASE}]))
    with RuntimeServer(
        tiny_model_dir, log,
        "--served-model-name", BASE, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8MiB",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--api-key", KEY,
        "--lora-modules", f"all={adapters['all']}", f"@{listing}",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    ) as running:  # fmt: skip
        yield running


async def _post(server, path: str, body: dict, key: str | None = KEY) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + path, json=body, headers=headers) as response:
            return response.status, await response.text()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def test_models_list_adapters_and_requests_select_them(server, tiny_model_dir, adapters):
    async def run():
        client = _client(server)
        models = (await client.models.list()).data
        assert [m.id for m in models] == [BASE, "all", "attn"]
        card = models[1].model_dump(exclude_unset=True)  # the fields the server sent
        assert card == {"id": "all", "object": "model", "created": card["created"], "owned_by": "hpi",
                        "root": str(adapters["all"]), "parent": BASE}  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        prompt = "The capital of France is"
        for name in ("all", "attn", BASE):
            out = await client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
            ref, _ = reference_greedy(tiny_model_dir, adapters.get(name), tokenizer(prompt).input_ids, 6)
            # The stream holds back an unfinished UTF-8 sequence at the end (random weights emit odd bytes).
            assert out.model == name and out.choices[0].text == tokenizer.decode(ref).rstrip("\ufffd"), name
        stream = await client.chat.completions.create(
            model="attn", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert {chunk.model for chunk in chunks} == {"attn"}
        with pytest.raises(openai.NotFoundError, match="'tiny-llama', 'all', 'attn'"):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)

    asyncio.run(run())


def test_structured_outputs_with_an_adapter(server):
    """A json_schema request for an adapter is constrained by the grammar and still runs the adapter: its JSON
    is valid and differs from the base model's under the same schema (on this random model, the adapters pick
    other words)."""
    colors = ["red", "green", "blue", "cyan", "black", "white", "pink", "gray"]
    schema = {"type": "object", "properties": {"tags": {"type": "array", "minItems": 4, "maxItems": 4,
              "items": {"enum": colors}}}, "required": ["tags"]}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "tags", "schema": schema}}

    async def run():
        client = _client(server)
        answers = {}
        for name in ("all", BASE):
            out = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Four colors"}], max_tokens=60, temperature=0,
                response_format=response_format,
            )  # fmt: skip
            tags = json.loads(out.choices[0].message.content)["tags"]
            assert len(tags) == 4 and set(tags) <= set(colors), (name, tags)
            answers[name] = tags
        assert answers["all"] != answers[BASE]

    asyncio.run(run())


def test_load_and_unload_under_load_lose_no_request(server, adapters):
    async def stream_all(client, model: str, started: asyncio.Event) -> tuple[str | None, int]:
        stream = await client.completions.create(model=model, prompt="one two three", max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        finish, num_chunks = None, 0
        async for chunk in stream:
            started.set()
            num_chunks += 1
            finish = chunk.choices[0].finish_reason or finish
        return finish, num_chunks

    async def run():
        client = _client(server)
        events = [asyncio.Event() for _ in range(6)]
        in_flight = [asyncio.create_task(stream_all(client, "all", e)) for e in events]
        await asyncio.gather(*(e.wait() for e in events))  # every request is streaming
        assert await _post(server, LOAD_PATH, {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}) == (
            200, "Success: LoRA adapter 'mlp' added successfully.")  # fmt: skip
        more = [asyncio.create_task(stream_all(client, "mlp", asyncio.Event())) for _ in range(3)]
        status, _ = await _post(server, UNLOAD_PATH, {"lora_name": "all"})
        assert status == 200
        results = await asyncio.gather(*in_flight, *more)
        assert all(finish == "length" for finish, _ in results), results
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="all", prompt="x", max_tokens=1)
        assert [m.id for m in (await client.models.list()).data] == [BASE, "attn", "mlp"]
        assert (await _post(server, UNLOAD_PATH, {"lora_name": "all"}))[0] == 404
        # Loaded again under the same name: served again.
        assert (await _post(server, LOAD_PATH, {"lora_name": "all", "lora_path": str(adapters["all"])}))[0] == 200
        out = await client.completions.create(model="all", prompt="x", max_tokens=2, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")

    asyncio.run(run())


def test_bad_adapters_are_400_and_change_nothing(server, tiny_model_dir, adapters, tmp_path):
    big = build_adapter(tiny_model_dir, tmp_path / "big", rank=16, targets=("q_proj",))
    empty = tmp_path / "empty"
    empty.mkdir()

    async def run():
        loaded = [m.id for m in (await _client(server).models.list()).data]
        status, text = await _post(server, LOAD_PATH, {"lora_name": "attn", "lora_path": str(adapters["attn"])})
        assert status == 400 and "The lora adapter 'attn' has already been loaded." in text
        status, text = await _post(server, LOAD_PATH, {"lora_name": "big", "lora_path": str(big)})
        assert status == 400 and "rank 16 is greater than max_lora_rank 8" in text
        status, text = await _post(server, LOAD_PATH, {"lora_name": "empty", "lora_path": str(empty)})
        assert status == 400 and "adapter_config.json" in text
        status, _ = await _post(server, LOAD_PATH, {"lora_name": "x"})
        assert status == 400
        status, _ = await _post(server, LOAD_PATH, {"lora_name": "x", "lora_path": str(big)}, key=None)
        assert status == 401
        assert [m.id for m in (await _client(server).models.list()).data] == loaded
        out = await _client(server).completions.create(model="attn", prompt="x", max_tokens=2)
        assert out.model == "attn"

    asyncio.run(run())


def test_metrics_name_the_adapters(server):
    async def use_every_adapter() -> None:  # whichever tests ran before on this server (xdist splits the module)
        client = _client(server)
        for model in [m.id for m in (await client.models.list()).data if m.id != BASE]:
            await client.completions.create(model=model, prompt="x", max_tokens=1)

    asyncio.run(use_every_adapter())
    text = server.metrics_text()
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and "running_lora_adapters=" in info[0]
    loads = [line for line in text.splitlines() if line.startswith("hpi:lora_loads_total{")]
    assert loads and float(loads[0].split()[-1]) >= 2
    assert any(line.startswith("hpi:lora_evictions_total{") for line in text.splitlines())


def test_runtime_updating_switch_reads_like_vllm():
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "TRUE"})
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"})
    assert not runtime_lora_updating_allowed({})
