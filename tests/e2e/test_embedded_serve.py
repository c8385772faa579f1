"""What a newcomer does first: `hpi serve` with no model (the embedded SmolLM2) and ask it a question."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from hpi_testing.server import RuntimeServer


@pytest.mark.slow
def test_embedded_model_answers_paris_over_http(tmp_path: Path) -> None:
    from hpi_runtime.embedded import ensure_embedded_model

    ensure_embedded_model()  # converted once into $HPI_CACHE_DIR; the server finds it by itself
    options = ("--kv-cache-memory", "256MiB", "--max-model-len", "2048")
    with RuntimeServer(None, tmp_path / "server.log", *options) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=20,
        )
        assert answer.choices[0].message.content == "The capital of France is Paris."
        assert answer.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=20,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
            "The capital of France is Paris."
        )
