"""A chat's images at the gateway: checked against the limits when the request is parsed (count, URL kind, encoded
size, a text-only model), then decoded and preprocessed once, on the tokenizer threads, with the checkpoint's own
image processor; their patches travel to the engine with the request (service/messages.py). Every failure is a
400 (413 over a size limit) naming the part, before anything is queued."""
from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from engine.multimodal.config import VisionSpec
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.media import IMAGE_FORMATS, ImageError, decode_data_url, open_image
from engine.multimodal.processor import ImageProcessor, expand_image_tokens
from service.config import GatewayConfig
from service.errors import APIError


def image_parts(messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The image parts of parsed messages (service/protocol.py ``parse_content_parts``), in prompt order."""
    for message in messages:
        if isinstance(message["content"], list):
            yield from (p for p in message["content"] if p["type"] == "image")


class GatewayImages:
    def __init__(self, config: GatewayConfig, model_path: str | None, tokenizer: Any = None) -> None:
        self.config, self.tokenizer = config, tokenizer  # the tokenizer: Gemma 3's expansion encodes newlines
        self.spec = _vision_spec(model_path)
        # Loaded with the gateway (its imports take seconds), not on a first image request's tokenizer thread.
        self._processor = None if self.spec is None else ImageProcessor(model_path)

    async def read(self, messages: list[dict[str, Any]]) -> None:
        """A chat's images admitted before it is tokenized, for a generation and /tokenize alike: the limits
        that need no decoding checked, then each allowed http(s) URL fetched."""
        self._check(messages)
        await self._fetch_urls(messages)

    def place(self, messages: list[dict[str, Any]], ids: list[int]) -> tuple[list[int], list[ImagePatches]]:
        """The rendered prompt ``ids`` with each image's placeholder expanded to its embedding rows, and the
        images' patches: decoded and preprocessed once (on a tokenizer thread, after ``read``)."""
        patches = self._patches(messages)
        return self._expand(ids, patches), patches

    def _check(self, messages: list[dict[str, Any]]) -> None:
        """The limits that need no decoding: the model takes images, how many, data URLs only, encoded size."""
        parts = list(image_parts(messages))
        if not parts:
            return
        if self.spec is None:
            raise APIError(400, "this model is text-only: it takes no images", param=parts[0]["param"])
        if len(parts) > self.config.max_images_per_request:
            raise APIError(400, f"{len(parts)} images, more than the {self.config.max_images_per_request} a request "
                                "may hold (max_images_per_request)", param="messages")
        for part in parts:
            url = part["url"]
            if url.startswith(("http://", "https://")):
                if urlsplit(url).hostname not in self.config.allowed_media_domains:
                    raise APIError(400, f"image URLs from {urlsplit(url).hostname!r} are not fetched by this server "
                                        "(--allowed-media-domains): send the image as a data URL "
                                        "(data:image/png;base64,...)", param=part["param"])
                continue
            if not url.startswith("data:"):
                raise APIError(400, "an image_url must be a data URL (data:image/png;base64,...)",
                               param=part["param"])
            if len(url) > max_data_url_chars(self.config.max_image_bytes):  # before any decoding
                raise APIError(413, f"the image is over the {self.config.max_image_bytes}-byte limit "
                                    "(max_image_bytes)", param=part["param"])

    async def _fetch_urls(self, messages: list[dict[str, Any]]) -> None:
        """Each allowed http(s) image URL fetched (``_check`` has passed): its bytes and MIME type join the part."""
        parts = [p for p in image_parts(messages) if p["url"].startswith(("http://", "https://"))]
        if not parts:
            return
        timeout = aiohttp.ClientTimeout(total=self.config.media_fetch_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for part in parts:
                part["fetched"] = await self._fetch(session, part)

    async def _fetch(self, session: aiohttp.ClientSession, part: dict[str, Any]) -> tuple[bytes, str]:
        limit, param = self.config.max_image_bytes, part["param"]
        try:
            async with session.get(part["url"], allow_redirects=False) as response:
                if response.status != 200:
                    raise APIError(400, f"fetching the image answered HTTP {response.status}", param=param)
                if response.content_type not in IMAGE_FORMATS:
                    raise APIError(400, f"unsupported image type {response.content_type!r} (accepted: image/png, "
                                        "image/jpeg, image/webp)", param=param)
                raw = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > limit:
                        break
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise APIError(400, f"the image could not be fetched: {exc!r}", param=param) from None
        if len(raw) > limit:
            raise APIError(413, f"the image is over the {limit}-byte limit (max_image_bytes)", param=param)
        return bytes(raw), response.content_type

    def _patches(self, messages: list[dict[str, Any]]) -> list[ImagePatches]:
        """Each image decoded and preprocessed: ImageError as the part's 400 / 413."""
        images = []
        for part in image_parts(messages):
            try:
                if "fetched" in part:
                    raw, mime = part["fetched"]
                    images.append(open_image(raw, IMAGE_FORMATS[mime], self.config.max_image_pixels))
                else:
                    images.append(decode_data_url(part["url"], self.config.max_image_bytes,
                                                  self.config.max_image_pixels))
            except ImageError as exc:
                raise APIError(exc.status, str(exc), param=part["param"]) from None
        return self._processor(images) if images else []

    def _expand(self, ids: list[int], patches: list[ImagePatches]) -> list[int]:
        """The prompt with one placeholder token per embedding row of each image (the template wrote one)."""
        if self.spec is None:
            return ids
        try:
            return expand_image_tokens(ids, patches, self.spec, self.tokenizer)
        except ValueError as exc:
            raise APIError(400, f"{exc} (the chat template must write one image placeholder per image part)",
                           param="messages") from None


def max_data_url_chars(max_bytes: int) -> int:
    """The longest data URL taken for an image of at most ``max_bytes``: its base64 (4 characters for 3 bytes),
    with room for the header."""
    return (4 * (max_bytes + 65) - 1) // 3


def _vision_spec(model_path: str | None) -> VisionSpec | None:
    if model_path is None:
        return None
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as f:
        return VisionSpec.from_hf(json.load(f))
