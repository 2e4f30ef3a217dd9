"""The engine's edge for a request's images: checked and placed (``build_inputs``), keyed for the prefix cache."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from engine.multimodal.block_keys import ImageBlockKeys
from engine.multimodal.config import VisionSpec
from engine.multimodal.inputs import ImagePatches, MultiModalInputs, build_inputs
from engine.multimodal.step import ImageStep


@dataclass(frozen=True, slots=True)
class RequestImages:
    spec: VisionSpec | None  # None: a text-only model
    architecture: str

    def inputs(self, prompt: list[int], images: list[ImagePatches], salt: bytes | None
               ) -> tuple[MultiModalInputs | None, bytes | ImageBlockKeys | None]:
        """The request's images placed in its prompt and its prefix-cache salt (its blocks' keys where it has
        images); ValueError for images to a text-only model or placeholders that do not match them."""
        if self.spec is None:
            if images:
                raise ValueError(f"this model ({self.architecture}) is text-only: it takes no images")
            return None, salt
        if not images and self.spec.image_token_id not in prompt:
            return None, salt
        multimodal, spans = build_inputs(prompt, images, self.spec)
        return multimodal, ImageBlockKeys(salt, spans)

    def step(self, model: nn.Module, cache_rows: int) -> ImageStep:
        return ImageStep(model.encode_images, cache_rows)
