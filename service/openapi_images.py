"""The OpenAPI schemas of image input, for a vision-language model's document (service/openapi.py): chat's
``image_url`` part, the Responses API's ``input_image`` part, Anthropic's ``image`` block, and the errors the
image limits answer. Each states what service/images.py takes: data URLs of the accepted formats within
``max_image_bytes`` (and http(s) URLs of ``--allowed-media-domains`` hosts); what no schema can state (the bytes
decode, the pixels, the count per request) is in the descriptions."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.multimodal.media import IMAGE_FORMATS

from service.config import GatewayConfig
from service.images import max_data_url_chars
from service.protocol import IMAGE_DETAILS

_BASE64 = "([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"
_MIME = "|".join(re.escape(mime) for mime in IMAGE_FORMATS)
_DETAIL = {"enum": list(IMAGE_DETAILS), "default": "auto",
           "description": "accepted and ignored: the checkpoint's image processor sets the resolution"}


@dataclass(frozen=True, slots=True)
class ImageSchemas:
    chat_part: dict[str, Any]  # chat completions' (and /tokenize's) image_url content part
    input_image: dict[str, Any]  # the Responses API's input_image content part
    anthropic_block: dict[str, Any]  # Anthropic's image block
    errors: dict[str, str]  # by status: what the image rules answer, for the routes that take images


def image_schemas(config: GatewayConfig) -> ImageSchemas:
    url = _url(config)
    limits = (f"at most {config.max_images_per_request} images per request (400 above, param 'messages'), each "
              f"at most {config.max_image_pixels} pixels, width x height (413 above)")
    chat_part = {"title": "ImageURLPart", "type": "object", "required": ["type", "image_url"],
                 "description": limits, "properties": {
                     "type": {"const": "image_url"},
                     "image_url": {"oneOf": [{"type": "object", "required": ["url"],
                                              "properties": {"url": url, "detail": _DETAIL}},
                                             {**url, "description": "the URL alone, as some clients send it"}]}}}
    input_image = {"title": "InputImagePart", "type": "object", "required": ["type", "image_url"],
                   "description": f"{limits}; file_id is not supported", "properties": {
                       "type": {"const": "input_image"}, "image_url": url, "detail": _DETAIL}}
    # Its base64 source becomes a data URL: the data's limit is that of the URL less its longest header.
    header = max(len(f"data:{mime};base64,") for mime in IMAGE_FORMATS)
    base64 = {"type": "object", "required": ["type", "media_type", "data"], "properties": {
        "type": {"const": "base64"}, "media_type": {"enum": list(IMAGE_FORMATS)},
        "data": {"type": "string", "pattern": f"^{_BASE64}$",
                 "maxLength": max_data_url_chars(config.max_image_bytes) - header}}}
    anthropic_block = {"title": "AnthropicImageBlock", "type": "object", "required": ["type", "source"],
                       "description": limits, "properties": {"type": {"const": "image"}, "source": {"oneOf": [
                           base64, {"type": "object", "required": ["type", "url"],
                                    "properties": {"type": {"const": "url"}, "url": url}}]}}}
    errors = {"400": "an image that cannot be read (corrupt, a MIME type its bytes do not match, a URL this server "
                     f"does not fetch, an unknown detail) or more than {config.max_images_per_request} of them: "
                     "error.param names the part",
              "413": f"an image over --max-image-bytes ({config.max_image_bytes} encoded) or --max-image-pixels "
                     f"({config.max_image_pixels}): error.param names the part"}
    return ImageSchemas(chat_part, input_image, anthropic_block, errors)


def _url(config: GatewayConfig) -> dict[str, Any]:
    """An image's URL: a data URL of an accepted format within max_image_bytes, or an allowed host's http(s) URL."""
    data = {"type": "string", "pattern": f"^data:({_MIME});base64,{_BASE64}$",
            "maxLength": max_data_url_chars(config.max_image_bytes),
            "description": "a data URL of a PNG, JPEG or WebP image (its bytes the format its MIME type names)"}
    if not config.allowed_media_domains:
        return data
    hosts = "|".join(re.escape(host) for host in config.allowed_media_domains)
    fetched = {"type": "string", "pattern": f"^https?://({hosts})(:[0-9]+)?([/?#]|$)",
               "description": "fetched by the gateway (--allowed-media-domains; no redirects, within "
                              "--media-fetch-timeout and --max-image-bytes)"}
    return {"oneOf": [data, fetched]}
