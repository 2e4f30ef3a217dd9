"""The checkpoint's own image processor (``AutoImageProcessor``, saved beside its tokenizer; not
``AutoProcessor``, whose Qwen2.5-VL video half needs torchvision), and the placeholder expansion the checkpoint's
processor does on text: each image's one placeholder token becomes one per embedding row."""
from __future__ import annotations

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

    def __call__(self, images: list[Image.Image]) -> list[ImagePatches]:
        if not images:
            return []
        out = self.hf(images=[image.convert("RGB") for image in images], return_tensors="pt")
        grids = [tuple(int(n) for n in grid) for grid in out["image_grid_thw"].tolist()]
        parts = out["pixel_values"].float().split([t * h * w for t, h, w in grids])
        return [ImagePatches(pixels.contiguous(), grid) for pixels, grid in zip(parts, grids)]


def expand_image_tokens(token_ids: list[int], images: list[ImagePatches], spec: VisionSpec) -> list[int]:
    """``token_ids`` with the i-th image placeholder token repeated once per embedding row of image i."""
    count = token_ids.count(spec.image_token_id)
    if count != len(images):
        raise ValueError(f"the prompt has {count} image placeholders for {len(images)} images")
    out, rows = [], iter(spec.rows(image.grid_thw) for image in images)
    for token in token_ids:
        out.extend([token] * next(rows) if token == spec.image_token_id else [token])
    return out
