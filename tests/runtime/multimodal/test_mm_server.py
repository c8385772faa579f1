"""Images through a real `hpi serve` process of the tiny Qwen2-VL: the official openai client sending a base64
image, image URLs fetched from a loopback HTTP server (an allowed host and one that is not), a file under the
allowed directory, and every bad input answered with a 400 that says what."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from pathlib import Path

import aiohttp.web
import openai
import pytest
import torch
from PIL import Image, PngImagePlugin

from hpi_runtime.models.config import load_model_config
from hpi_runtime.multimodal.processor import ImageProcessor
from hpi_testing.server import RuntimeServer, post_json, serving
from hpi_testing.tiny_vlm import png_data_url, random_image

NAME = "tiny-vl"
IMAGE = random_image(70, 60, seed=11)
SERVED = random_image(64, 64, seed=12)  # by the loopback host and in the media directory


def _png(image: Image.Image, padding_bytes: int = 0) -> bytes:
    buffer = io.BytesIO()
    info = PngImagePlugin.PngInfo()
    if padding_bytes:  # a text chunk: many bytes, few pixels
        info.add_text("padding", "x" * padding_bytes)
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


class ImageHost:
    """A loopback aiohttp server in its own thread: GET /image.png, /missing (404) and /hang (answers only
    when the test ends, so a fetch of it times out)."""

    def __init__(self) -> None:
        self.port: int | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._release: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    async def _serve(self) -> None:
        self._release = asyncio.Event()

        async def image(_):
            return aiohttp.web.Response(body=_png(SERVED), content_type="image/png")

        async def hang(_):
            await self._release.wait()
            return aiohttp.web.Response(body=b"")

        app = aiohttp.web.Application()
        app.router.add_get("/image.png", image)
        app.router.add_get("/hang", hang)
        async with serving(app) as port:
            self.port = port
            self._ready.set()
            await self._release.wait()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    (directory / "image.png").write_bytes(_png(SERVED))
    return directory


@pytest.fixture(scope="module")
def vl_server(tiny_vlm_dir: Path, media_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("vl-server") / "server.log"
    with RuntimeServer(
        tiny_vlm_dir, log,
        "--served-model-name", NAME, "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--dtype", "float32",
        "--enforce-eager", "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "localhost",
        "--allowed-local-media-path", str(media_dir), "--media-fetch-timeout", "1", "--max-image-pixels", "20000",
        "--max-image-bytes", "60KB",
    ) as running:  # fmt: skip
        yield running


def _chat(server, *image_urls: str, text: str = "What is this?", before: str = "") -> tuple[int, dict]:
    parts = [{"type": "text", "text": before}] if before else []
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in image_urls] + [{"type": "text", "text": text}]
    body = {"model": NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 4, "temperature": 0}
    return post_json(server.base_url, "/v1/chat/completions", body)


def _expected(tiny_vlm_dir: Path, hf_vlm, text: str) -> tuple[int, str]:
    """(prompt tokens, greedy text) of IMAGE + text, by transformers with the model's own processor."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    config = load_model_config(tiny_vlm_dir)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    ids, mm_inputs = ImageProcessor(tiny_vlm_dir, config.architecture, config.vision).process(
        tokenizer(rendered, add_special_tokens=False).input_ids, [IMAGE]
    )
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_vlm.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, do_sample=False,
            pixel_values=torch.from_numpy(mm_inputs[0].pixel_values),
            image_grid_thw=torch.tensor([mm_inputs[0].grid_thw]),
            mm_token_type_ids=(input_ids == config.vision.image_token_id).int(),
        )  # fmt: skip
    return len(ids), tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_openai_client_sends_a_base64_image(vl_server, tiny_vlm_dir, hf_vlm) -> None:
    client = openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.chat.completions.create(
        model=NAME, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(IMAGE)}},
                                               {"type": "text", "text": "What is this?"}]}],
    )  # fmt: skip
    num_prompt_tokens, text = _expected(tiny_vlm_dir, hf_vlm, "What is this?")
    assert response.usage.prompt_tokens == num_prompt_tokens
    # The stream ends mid-character (random weights): the server holds back an incomplete UTF-8 sequence.
    assert response.choices[0].message.content == text.rstrip("\ufffd")


def test_an_allowed_url_and_a_local_file_give_the_data_url_answer(vl_server, image_host, media_dir) -> None:
    before = vl_server.metric_samples()
    answers = []
    # Different text before the image each time: its KV is not in the prefix cache, its embedding is.
    for i, url in enumerate([png_data_url(SERVED), f"http://localhost:{image_host.port}/image.png",
                             (media_dir / "image.png").as_uri()]):  # fmt: skip
        status, body = _chat(vl_server, url, before=f"Look {i}:")
        assert status == 200, body
        answers.append(body)
    assert len({body["usage"]["prompt_tokens"] for body in answers}) == 1
    after = vl_server.metric_samples()
    counted = {name: after[name] - before[name] for name in ("hpi:encoder_cache_queries_total",
                                                             "hpi:encoder_cache_hits_total")}  # fmt: skip
    assert counted == {"hpi:encoder_cache_queries_total": 3, "hpi:encoder_cache_hits_total": 2}  # encoded once


def _data(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(payload).decode()


BAD_INPUTS = {
    "undecodable": (lambda host: [_data(b"this is not an image")], "cannot be decoded"),
    "bad-base64": (lambda host: ["data:image/png;base64,@@@"], "base64"),
    "not-an-image-type": (lambda host: [_data(b"{}", "application/json")], "is not an image"),
    "too-many": (lambda host: [png_data_url(IMAGE)] * 3, "at most 2"),
    "too-many-pixels": (lambda host: [png_data_url(Image.new("RGB", (200, 200)))], "--max-image-pixels"),
    "too-many-bytes": (lambda host: [_data(_png(IMAGE, padding_bytes=80_000))], "--max-image-bytes"),
    "host-not-allowed": (lambda host: [f"http://127.0.0.1:{host.port}/image.png"], "not allowed"),
    "http-error": (lambda host: [f"http://localhost:{host.port}/missing"], "HTTP 404"),
    "fetch-timeout": (lambda host: [f"http://localhost:{host.port}/hang"], "Timeout"),
    "file-outside": (lambda host: ["file:///etc/hostname"], "--allowed-local-media-path"),
    "scheme": (lambda host: ["ftp://localhost/image.png"], "data:, http(s): or file:"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=str)
def test_bad_images_are_a_400_that_says_what(vl_server, image_host, case: str) -> None:
    urls, message = BAD_INPUTS[case]
    status, body = _chat(vl_server, *urls(image_host))
    assert status == 400, body
    assert message in body["error"]["message"], body
    assert body["error"]["param"] == "messages"


def test_a_part_that_is_neither_text_nor_an_image_is_a_400(vl_server) -> None:
    body = {"model": NAME, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}  # fmt: skip
    status, answer = post_json(vl_server.base_url, "/v1/chat/completions", body)
    assert status == 400 and "content parts must be 'text'" in answer["error"]["message"]
    assert json.dumps(answer).count("input_audio") == 0  # the message names what is accepted
