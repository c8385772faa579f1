"""A chat request's images, from its image_url parts to the engine's `MultiModalInput`s: the per-prompt limit,
fetching and decoding (multimodal/media.py, off the event loop) and the model's processor (in a thread). Each
refusal is a 400 that says what: no image support, too many, not allowed, not decodable, too large."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hpi_runtime.config import MultimodalConfig
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.multimodal.media import MediaError, MediaPolicy, load_image
from hpi_runtime.multimodal.processor import ImageProcessor
from hpi_runtime.server.errors import bad_request


@dataclass(frozen=True)
class ImageSupport:
    """What a vision-language model's server needs to take images."""

    processor: ImageProcessor
    policy: MediaPolicy
    max_images: int  # per prompt (--limit-mm-per-prompt)

    @classmethod
    def for_model(cls, model_config: ModelConfig, options: MultimodalConfig) -> ImageSupport | None:
        """None for a text-only model."""
        if model_config.vision is None:
            return None
        policy = MediaPolicy(
            allowed_domains=tuple(d.lower() for d in options.allowed_media_domains or ()),
            allowed_local_path=options.allowed_local_media_path,
            timeout_s=options.media_fetch_timeout_s,
            max_bytes=options.max_image_bytes,
            max_pixels=options.max_image_pixels,
        )
        processor = ImageProcessor(model_config.model_dir, model_config.architecture, model_config.vision)
        return cls(processor, policy, options.max_images_per_prompt)


async def read_images(
    support: ImageSupport | None, image_urls: tuple[str, ...], prompt_ids: list[int]
) -> tuple[list[int], tuple[MultiModalInput, ...]]:
    """The prompt with its image placeholders expanded, and its images; a 400 naming what is wrong."""
    if support is None:
        raise bad_request("this model takes no images (it is a text-only model); send text content only",
                          "messages", "images_not_supported")  # fmt: skip
    if len(image_urls) > support.max_images:
        raise bad_request(f"this request has {len(image_urls)} images; at most {support.max_images} are allowed "
                          "per prompt (--limit-mm-per-prompt)", "messages", "too_many_images")  # fmt: skip
    results = await asyncio.gather(*(load_image(url, support.policy) for url in image_urls), return_exceptions=True)
    for i, result in enumerate(results):
        if isinstance(result, MediaError):
            raise bad_request(f"image {i + 1}: {result}", "messages", "invalid_image")
        if isinstance(result, BaseException):
            raise result
    try:
        return await asyncio.to_thread(support.processor.process, prompt_ids, results)
    except ValueError as exc:
        raise bad_request(str(exc), "messages", "invalid_image") from exc
