"""Images from data URLs (base64 PNG, JPEG or WebP), bounded before they are decoded: the offline ``LLM.chat``
and the gateway read them the same way. The engine never fetches a URL."""
from __future__ import annotations

import base64
import binascii
import io
import warnings

from PIL import Image

# Each accepted MIME type and the format PIL must find in the bytes.
IMAGE_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


class ImageError(ValueError):
    """A bad image: 400."""

    status = 400


class ImageTooLarge(ImageError):
    """Over a size limit: 413."""

    status = 413


def decode_data_url(url: str, max_bytes: int, max_pixels: int) -> Image.Image:
    """The image of a ``data:<mime>;base64,<data>`` URL, at most ``max_bytes`` encoded and ``max_pixels`` in area."""
    head, sep, data = url.partition(",")
    if not head.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ImageError("an image must be a data URL (data:image/png;base64,...)")
    mime = head[len("data:"):-len(";base64")].strip().lower()
    if mime not in IMAGE_FORMATS:
        raise ImageError(f"unsupported image type {mime!r} (accepted: image/png, image/jpeg, image/webp)")
    if len(data) * 3 // 4 > max_bytes:
        raise ImageTooLarge(f"the image is over the {max_bytes}-byte limit")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's data is not valid base64") from None
    return open_image(raw, IMAGE_FORMATS[mime], max_pixels)


def open_image(raw: bytes, expected_format: str, max_pixels: int) -> Image.Image:
    """Decoded from ``raw``, which must hold ``expected_format``; its size is checked from the header first."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            if image.format != expected_format:
                raise ImageError(f"the image's data is {image.format or 'no known format'}, its MIME type says "
                                 f"{expected_format}")
            if image.width * image.height > max_pixels:
                raise ImageTooLarge(f"the image is {image.width}x{image.height} pixels, over the limit of "
                                    f"{max_pixels} pixels")
            image.load()
    except ImageError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ImageError("the image's data cannot be decoded (corrupt or truncated)") from None
    return image.convert("RGB")
