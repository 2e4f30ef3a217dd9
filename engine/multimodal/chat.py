"""OpenAI-shaped chat messages with image parts, for the offline ``LLM.chat``: image parts become the chat
template's ``{"type": "image"}`` and their images are returned in order."""
from __future__ import annotations

from PIL import Image

from engine.multimodal.media import decode_data_url

# The offline reader's bounds: generous, but a bad part still fails before anything is decoded in full.
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 64 << 20


def split_images(messages: list[dict]) -> tuple[list[dict], list[Image.Image]]:
    """The messages as the chat template reads them, and their images. Image parts: ``image_url`` (a data URL),
    ``image_pil`` (vLLM's) or ``image`` holding a PIL image."""
    rendered, images = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            image = _image_of(part)
            if image is None:
                parts.append(part)
            else:
                images.append(image)
                parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images


def _image_of(part: dict) -> Image.Image | None:
    kind = part.get("type")
    if kind == "image_url":
        url = part["image_url"]["url"] if isinstance(part.get("image_url"), dict) else part.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ValueError("an image_url part must hold a data URL offline (the engine fetches no URL)")
        return decode_data_url(url, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS)
    if kind in ("image_pil", "image") and isinstance(part.get(kind), Image.Image):
        return part[kind]
    if kind in ("image_pil", "image"):
        raise ValueError(f"a {kind} part must hold a PIL image under {kind!r}")
    return None
