"""Read the image an `image_url` part names: a data: URL (base64 PNG, JPEG, WebP or GIF), an http(s) URL on a
host the operator allowed (`--allowed-media-domains`), or a file:// URL under `--allowed-local-media-path`, as
vLLM allows them. Downloads go through aiohttp with a timeout and a byte limit; decoding (PIL) runs in a thread,
so neither blocks the event loop. Every refusal is a `MediaError` that says what was wrong (a 400 at the edge).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import aiohttp
from PIL import Image, UnidentifiedImageError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class MediaError(ValueError):
    """An image the request names cannot be used; the message says why."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be (config.MultimodalConfig, resolved)."""

    allowed_domains: tuple[str, ...] = ()  # http(s) hosts; empty: no URL is fetched
    allowed_local_path: str | None = None  # a directory; None: no file is read
    timeout_s: float = 5.0
    max_bytes: int = 20 * 10**6
    max_pixels: int = 25_000_000


async def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """The RGB image `url` names; MediaError when it is not allowed, not reachable or not an image."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        data = _data_url_bytes(url, policy.max_bytes)
    elif scheme in ("http", "https"):
        data = await _fetch(url, policy)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_file, url, policy)
    else:
        raise MediaError(f"image URLs must be data:, http(s): or file: URLs, got {url[:40]!r}")
    return await asyncio.to_thread(decode_image, data, policy.max_pixels)


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError("a data: image URL must be 'data:image/<type>;base64,<data>'")
    media_type = header.removeprefix("data:").removesuffix(";base64").split(";")[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"a data: URL of type {media_type!r} is not an image")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise MediaError(f"the image is larger than {max_bytes} bytes (--max-image-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the data: URL's base64 does not decode: {exc}") from exc
    if len(data) > max_bytes:
        raise MediaError(f"the image is larger than {max_bytes} bytes (--max-image-bytes)")
    return data


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in policy.allowed_domains:
        raise MediaError(f"image URLs on host {host!r} are not allowed (the server's --allowed-media-domains "
                         f"lists {', '.join(policy.allowed_domains) or 'none'})")  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=policy.timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, allow_redirects=False) as response,
        ):
            if response.status != 200:
                raise MediaError(f"fetching the image URL answered HTTP {response.status}")
            if (response.content_length or 0) > policy.max_bytes:
                raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-image-bytes)")
            data = await response.content.read(policy.max_bytes + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise MediaError(f"fetching the image URL failed: {type(exc).__name__} {exc}".strip()) from exc
    if len(data) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-image-bytes)")
    return data


def _read_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError("file: image URLs are not allowed (the server has no --allowed-local-media-path)")
    root = os.path.realpath(policy.allowed_local_path)
    path = os.path.realpath(unquote(urlsplit(url).path))
    if os.path.commonpath([root, path]) != root:
        raise MediaError("file: image URLs must name a file under the server's --allowed-local-media-path")
    try:
        if os.path.getsize(path) > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes (--max-image-bytes)")
        with open(path, "rb") as f:
            return f.read(policy.max_bytes + 1)
    except OSError as exc:
        raise MediaError(f"the image file cannot be read: {exc.strerror}") from exc


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """PNG/JPEG/WebP/GIF bytes -> an RGB image; its size is checked from the header, before decoding."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        if image.width * image.height > max_pixels:
            raise MediaError(f"the image is {image.width}x{image.height} pixels, more than {max_pixels} "
                             "(--max-image-pixels)")  # fmt: skip
        image.load()
        return image.convert("RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"the image cannot be decoded as {'/'.join(IMAGE_FORMATS)}: {exc}") from exc
