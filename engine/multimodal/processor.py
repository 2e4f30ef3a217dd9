"""The checkpoint's own image processor (``AutoImageProcessor``, saved beside its tokenizer; not
``AutoProcessor``, whose Qwen2.5-VL video half needs torchvision), and the placeholder expansion the checkpoint's
processor does on text: each image's one placeholder token becomes one per embedding row (Gemma 3: wrapped in its
start / end tokens and "\\n\\n", as its processor writes them)."""
from __future__ import annotations

from itertools import groupby

from PIL import Image

from engine.multimodal.config import VisionSpec
from engine.multimodal.inputs import ImagePatches


class ImageProcessor:
    def __init__(self, path: str) -> None:
        from transformers import AutoImageProcessor  # heavy import, only for a vision-language model

        try:
            self.hf = AutoImageProcessor.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: no image processor (preprocessor_config.json) beside the checkpoint: {e}")
        if getattr(self.hf, "do_pan_and_scan", None):
            raise ValueError(f"{path}/preprocessor_config.json: do_pan_and_scan is not supported (each image is "
                             "one fixed-size square): set it to false")

    def __call__(self, images: list[Image.Image]) -> list[ImagePatches]:
        if not images:
            return []
        out = self.hf(images=[image.convert("RGB") for image in images], return_tensors="pt")
        if "image_grid_thw" not in out:  # one fixed-size square each (Gemma 3): its pixels, channels last
            return [ImagePatches(pixels.permute(1, 2, 0).reshape(-1, pixels.shape[0]).contiguous(),
                                 (1, pixels.shape[1], pixels.shape[2])) for pixels in out["pixel_values"].float()]
        grids = [tuple(int(n) for n in grid) for grid in out["image_grid_thw"].tolist()]
        parts = out["pixel_values"].float().split([t * h * w for t, h, w in grids])
        return [ImagePatches(pixels.contiguous(), grid) for pixels, grid in zip(parts, grids)]


def expand_image_tokens(token_ids: list[int], images: list[ImagePatches], spec: VisionSpec,
                        tokenizer=None) -> list[int]:
    """``token_ids`` with the i-th image placeholder token repeated once per embedding row of image i; Gemma 3's
    wrapped as its processor does, which needs the ``tokenizer``."""
    count = token_ids.count(spec.placeholder_id)
    if count != len(images):
        raise ValueError(f"the prompt has {count} image placeholders for {len(images)} images")
    if spec.wrap is not None:
        if tokenizer is None:
            raise ValueError("Gemma 3's image placeholders expand with the tokenizer (their newlines join the text)")
        return _wrapped(token_ids, images, spec, tokenizer)
    out, rows = [], iter(spec.rows(image.grid_thw) for image in images)
    for token in token_ids:
        out.extend([token] * next(rows) if token == spec.image_token_id else [token])
    return out


def _wrapped(token_ids: list[int], images: list[ImagePatches], spec: VisionSpec, tokenizer) -> list[int]:
    """Gemma 3's processor replaces the start token's text with "\\n\\n<start>", the image tokens, "<end>\\n\\n"
    and tokenizes: the newlines join the text around them (a newline run is one token in Gemma's vocabulary). So
    the text between added tokens is decoded, given the images' newlines and encoded again, as the processor's
    tokenizer sees it."""
    wrap, added = spec.wrap, set(tokenizer.added_tokens_decoder)
    rows = iter(spec.rows(image.grid_thw) for image in images)
    parts: list[str | list[int]] = []  # text, and added tokens' ids
    for is_text, run in groupby(token_ids, key=lambda t: t not in added):
        if is_text:
            parts.append(tokenizer.decode(list(run), clean_up_tokenization_spaces=False))
            continue
        for token in run:
            image = [token, *[spec.image_token_id] * next(rows), wrap.end_id] if token == wrap.start_id else None
            parts += [[token]] if image is None else ["\n\n", image, "\n\n"]
    out: list[int] = []
    for is_text, run in groupby(parts, key=lambda p: isinstance(p, str)):
        out += tokenizer.encode("".join(run), add_special_tokens=False) if is_text else [t for p in run for t in p]
    return out
