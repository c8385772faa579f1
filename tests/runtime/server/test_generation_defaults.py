"""A model's generation_config.json sampling settings are the server's defaults for requests that leave them
out (as vLLM's --generation-config auto), while a request's own values still win; `priority` is accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from hpi_testing.server import RuntimeServer

MESSAGES = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def greedy_by_default(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("model") / "greedy-tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0}))
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RuntimeServer(model_dir, log, "--max-model-len", "128", "--kv-cache-memory", "4MiB",
                       "--dtype", "float32") as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(greedy_by_default: RuntimeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{greedy_by_default.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _texts(client: openai.OpenAI, *, extra: dict | None = None, **kwargs) -> list[str]:
    result = client.chat.completions.create(model="greedy-tiny", messages=MESSAGES, max_tokens=12,
                                            extra_body={"ignore_eos": True, **(extra or {})}, **kwargs)  # fmt: skip
    return [choice.message.content for choice in result.choices]


def test_requests_without_temperature_take_the_models_default(client: openai.OpenAI) -> None:
    greedy = _texts(client, temperature=0)[0]
    # Sampling at the OpenAI default temperature 1.0 would give four different random continuations.
    assert _texts(client, n=4) == [greedy] * 4


def test_a_requests_own_setting_wins(client: openai.OpenAI) -> None:
    sampled = _texts(client, n=4, temperature=1.0, seed=3)
    assert len(set(sampled)) > 1


def test_priority_is_accepted(client: openai.OpenAI) -> None:
    assert _texts(client, temperature=0, extra={"priority": -5}) == _texts(client, temperature=0)
