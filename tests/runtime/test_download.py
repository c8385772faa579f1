"""The model downloader against a fake Hugging Face hub over HTTP (aiohttp on loopback).

The fake speaks the two endpoints huggingface_hub and the downloader use: the repo metadata
(`/api/models/<id>/revision/<rev>?blobs=true`, sizes, sha256 and git blob ids) and file downloads
(`/<id>/resolve/<commit>/<file>`, with Range). Faults are injected per file: a connection dropped after some
bytes, or bytes that do not match the metadata.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp.web
import pytest

from hpi_runtime import download
from hpi_runtime.download import MARKER_FILE, WORK_DIR, DownloadError, download_model, is_complete, remove_download

REPO_ID = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _files() -> dict[str, bytes]:
    index = {"metadata": {"total_size": 0}, "weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}}
    return {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"eos_token": "</s>"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARDS[0]: os.urandom(3 << 20),
        SHARDS[1]: os.urandom(1 << 20),
        # Same weights in another naming, as Mistral's repos ship them: never to be fetched.
        "consolidated.safetensors": os.urandom(1 << 20),
        "README.md": b"# tiny",
    }


def _sibling(name: str, data: bytes) -> dict:
    git_oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    entry = {"rfilename": name, "size": len(data), "blobId": git_oid}
    if name.endswith(".safetensors"):
        entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
    return entry


@dataclass
class FakeHub:
    files: dict[str, bytes] = field(default_factory=_files)
    drop_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the connection drops
    drops_left: dict[str, int] = field(default_factory=dict)  # file -> how many requests still drop
    served: dict[str, bytes] = field(default_factory=dict)  # file -> bytes served instead (corruption)
    requests: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # (file, Range, auth)
    url: str = ""

    async def info(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.match_info["repo"] != REPO_ID or request.query.get("blobs", "").lower() != "true":
            return aiohttp.web.json_response({"error": "not found"}, status=404)
        siblings = [_sibling(name, data) for name, data in self.files.items()]
        return aiohttp.web.json_response({"id": REPO_ID, "sha": COMMIT, "siblings": siblings})

    async def resolve(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        name, revision = request.match_info["file"], request.match_info["revision"]
        self.requests.append((name, request.headers.get("Range"), request.headers.get("Authorization")))
        if revision != COMMIT or name not in self.files:
            return aiohttp.web.Response(status=404)
        data = self.served.get(name, self.files[name])
        start = 0
        if request.headers.get("Range"):
            start = int(request.headers["Range"].removeprefix("bytes=").split("-")[0])
        response = aiohttp.web.StreamResponse(status=206 if start else 200)
        response.content_length = len(data) - start
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await response.prepare(request)
        if self.drops_left.get(name, 0) > 0:
            self.drops_left[name] -= 1
            await response.write(data[start : start + self.drop_after[name]])
            await asyncio.sleep(0.05)  # let the bytes leave before the connection goes
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write(data[start:])
        await response.write_eof()
        return response

    def fetched(self, name: str) -> list[str | None]:
        return [rng for file, rng, _ in self.requests if file == name]


@pytest.fixture()
async def hub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHub]:
    monkeypatch.setattr(download, "RETRY_BASE_DELAY_S", 0.0)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    fake = FakeHub()
    app = aiohttp.web.Application()
    app.router.add_get("/api/models/{repo:[^/]+/[^/]+}/revision/{revision}", fake.info)
    app.router.add_get("/{repo:[^/]+/[^/]+}/resolve/{revision}/{file:.+}", fake.resolve)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    await runner.cleanup()


async def fetch(hub: FakeHub, target: Path, token: str | None = None) -> download.DownloadResult:
    # The downloader is synchronous: off the loop that serves the fake hub.
    return await asyncio.to_thread(download_model, REPO_ID, target, "main", token, hub.url)


async def test_fetches_configs_and_indexed_shards_only_verified(hub: FakeHub, tmp_path: Path) -> None:
    result = await fetch(hub, tmp_path / "m", token="hf_secret")
    wanted = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json", *SHARDS}
    assert {f.name for f in result.files} == wanted
    assert result.commit == COMMIT and result.num_fetched_bytes == sum(len(hub.files[n]) for n in wanted)
    for name in wanted:
        assert (tmp_path / "m" / name).read_bytes() == hub.files[name]
    assert not (tmp_path / "m" / "consolidated.safetensors").exists() and not hub.fetched("consolidated.safetensors")
    assert not hub.fetched("README.md")
    assert {auth for _, _, auth in hub.requests} == {"Bearer hf_secret"}
    marker = json.loads((tmp_path / "m" / MARKER_FILE).read_text())
    assert marker["commit"] == COMMIT and marker["files"][SHARDS[0]] == 3 << 20
    assert is_complete(tmp_path / "m")

    # Idempotent: a second run (the next pod, a re-run Job) transfers nothing.
    hub.requests.clear()
    again = await fetch(hub, tmp_path / "m")
    assert again.num_fetched_bytes == 0 and hub.requests == []


async def test_dropped_connection_resumes_with_a_range_request(hub: FakeHub, tmp_path: Path) -> None:
    hub.drop_after[SHARDS[0]], hub.drops_left[SHARDS[0]] = 1_000_000, 2
    result = await fetch(hub, tmp_path / "m")
    assert (tmp_path / "m" / SHARDS[0]).read_bytes() == hub.files[SHARDS[0]]
    ranges = hub.fetched(SHARDS[0])
    assert ranges[0] is None and len(ranges) == 3
    starts = [int(r.removeprefix("bytes=").rstrip("-")) for r in ranges[1:] if r]
    assert len(starts) == 2 and 0 < starts[0] < starts[1] <= 2_000_000, ranges  # each try went on from the last
    # Each byte crossed the wire once: resumed, not restarted.
    assert result.num_fetched_bytes == sum(f.size for f in result.files)


async def test_killed_run_leaves_no_marker_and_the_next_run_resumes(hub: FakeHub, tmp_path: Path) -> None:
    hub.drop_after[SHARDS[0]], hub.drops_left[SHARDS[0]] = 700_000, 1
    hub.drop_after[SHARDS[1]], hub.drops_left[SHARDS[1]] = 200_000, download.NUM_TRANSFER_TRIES
    with pytest.raises(DownloadError, match="giving up"):
        await fetch(hub, tmp_path / "m")
    assert not is_complete(tmp_path / "m") and not (tmp_path / "m" / MARKER_FILE).exists()
    assert not (tmp_path / "m" / SHARDS[1]).exists()  # nothing unverified at its final name
    part = tmp_path / "m" / WORK_DIR / f"{SHARDS[1]}.part"
    have = part.stat().st_size
    assert 0 < have <= 200_000 * download.NUM_TRANSFER_TRIES

    hub.requests.clear()
    result = await fetch(hub, tmp_path / "m")
    assert hub.fetched(SHARDS[0]) == []  # verified earlier: not fetched again
    assert hub.fetched(SHARDS[1]) == [f"bytes={have}-"]
    assert result.num_fetched_bytes == len(hub.files[SHARDS[1]]) - have
    assert (tmp_path / "m" / SHARDS[1]).read_bytes() == hub.files[SHARDS[1]]
    assert is_complete(tmp_path / "m") and not part.exists()


async def test_bytes_that_do_not_match_the_metadata_are_rejected(hub: FakeHub, tmp_path: Path) -> None:
    good = hub.files[SHARDS[1]]
    hub.served[SHARDS[1]] = good[:-1] + bytes([good[-1] ^ 0xFF])  # same size, one bit pattern off
    with pytest.raises(DownloadError, match=rf"{SHARDS[1]}: .* sha256"):
        await fetch(hub, tmp_path / "m")
    assert not (tmp_path / "m" / SHARDS[1]).exists()
    assert not (tmp_path / "m" / WORK_DIR / f"{SHARDS[1]}.part").exists()  # the next try starts clean
    assert not is_complete(tmp_path / "m")

    hub.served.clear()  # the hub (or the proxy in between) recovers: the retry succeeds
    await fetch(hub, tmp_path / "m")
    assert is_complete(tmp_path / "m")


async def test_small_files_are_checked_by_git_blob_id(hub: FakeHub, tmp_path: Path) -> None:
    hub.served["config.json"] = b'{"model_type": "LLAMA"}'  # same size, other content
    with pytest.raises(DownloadError, match="config.json: .* git blob id"):
        await fetch(hub, tmp_path / "m")


async def test_serve_by_hub_id_uses_this_downloader(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hpi serve org/name` (llm.resolve_model_dir) goes through the same verified download, into HF_HOME."""
    import huggingface_hub.constants

    from hpi_runtime.model_source import resolve_model_dir

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(tmp_path / "hf"))
    model_dir, name = await asyncio.to_thread(resolve_model_dir, REPO_ID)
    assert name == REPO_ID and model_dir == tmp_path / "hf" / "hpi-models" / REPO_ID / "main"
    assert is_complete(model_dir) and not hub.fetched("consolidated.safetensors")


def test_check_and_remove_cli(tmp_path: Path) -> None:
    target = tmp_path / "rev"
    assert download.main(["check", str(target)]) == 1
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / MARKER_FILE).write_text(json.dumps({"files": {"config.json": 2}}))
    assert download.main(["check", str(target)]) == 0
    (target / "config.json").write_text("{}  ")  # a file changed or truncated after the fact
    assert download.main(["check", str(target)]) == 1
    with pytest.raises(DownloadError, match="not a model download"):
        remove_download(tmp_path)  # never deletes a directory it did not write
    assert download.main(["remove", str(target)]) == 0 and not target.exists()


async def test_an_adapter_fetch_takes_the_peft_files_and_refuses_a_repo_without_them(hub: FakeHub,
                                                                                      tmp_path: Path) -> None:
    adapter_weights = os.urandom(1 << 16)
    hub.files = {"adapter_config.json": b'{"peft_type": "LORA", "r": 8}', "adapter_model.safetensors": adapter_weights,
                 "README.md": b"# adapter", "training_args.bin": b"pickle"}  # fmt: skip
    result = await asyncio.to_thread(download_model, REPO_ID, tmp_path / "a", "main", None, hub.url, True)
    assert {f.name for f in result.files} == {"adapter_config.json", "adapter_model.safetensors"}
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == adapter_weights
    assert is_complete(tmp_path / "a")
    del hub.files["adapter_config.json"]
    with pytest.raises(DownloadError, match="not a PEFT adapter"):
        await asyncio.to_thread(download_model, REPO_ID, tmp_path / "b", "main", None, hub.url, True)
