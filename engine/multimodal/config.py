"""A vision-language checkpoint's settings: transformers 5 saves the language model's under ``text_config`` and the
vision tower's under ``vision_config``; the engine reads the text ones where a text-only checkpoint has them."""
from __future__ import annotations

from dataclasses import dataclass

# The architectures whose images the engine encodes (engine/models: the families with a ``vision`` entry).
IMAGE_ARCHITECTURES = frozenset({"Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                                 "Gemma3ForConditionalGeneration"})
# Keys whose top-level value holds for the language model too (transformers ties the LM head by the top level's
# tie_word_embeddings); the text model's own model_type stays (the families read it, e.g. gemma4_text).
_TOP_LEVEL = ("architectures", "tie_word_embeddings", "quantization_config", "dtype", "torch_dtype")


def lift_text_config(hf: dict) -> dict:
    """``hf`` with its ``text_config`` settings at the top level (as a text-only config.json has them); ``hf``
    itself where it has none."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    return {**hf, **text, **{key: hf[key] for key in _TOP_LEVEL if key in hf}}


@dataclass(frozen=True, slots=True)
class ImageWrap:
    """Gemma 3's images: the chat template writes ``start_id`` once per image, which the processor turns into
    "\\n\\n", ``start_id``, the image's tokens, ``end_id``, "\\n\\n"; the image is one fixed square
    (``image_size`` pixels, no pan-and-scan), its tokens take plain positions and attend to each other both ways."""

    start_id: int
    end_id: int
    image_size: int


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What the engine needs to place a checkpoint's images in a prompt."""

    image_token_id: int  # the placeholder token, one per embedding row of an image
    merge_size: int  # patches merged per side into one embedding row (spatial_merge_size; Gemma 3: pixels)
    wrap: ImageWrap | None = None  # Gemma 3's rule; None: Qwen's (one placeholder expanded, M-RoPE, causal)

    @classmethod
    def from_hf(cls, hf: dict) -> VisionSpec | None:
        """None for a text-only checkpoint, and for one whose vision tower the engine does not run (Gemma 4's
        multimodal checkpoints: their text model runs alone)."""
        vision = hf.get("vision_config")
        if not isinstance(vision, dict) or (hf.get("architectures") or [None])[0] not in IMAGE_ARCHITECTURES:
            return None
        if "mm_tokens_per_image" in hf:
            return cls._gemma3(hf, vision)
        if not isinstance(hf.get("image_token_id"), int):
            raise ValueError("config.json: a vision_config needs an integer image_token_id")
        return cls(hf["image_token_id"], int(vision.get("spatial_merge_size", 2)))

    @classmethod
    def _gemma3(cls, hf: dict, vision: dict) -> VisionSpec:
        """One embedding row per pooled cell: a cell is image_size / sqrt(mm_tokens_per_image) pixels square."""
        per_side, size = round(hf["mm_tokens_per_image"] ** 0.5), int(vision["image_size"])
        ids = [hf.get(key, hf.get(key.replace("_id", "_index"))) for key in ("image_token_id", "boi_token_id",
                                                                              "eoi_token_id")]
        if not all(isinstance(i, int) for i in ids):
            raise ValueError("config.json: Gemma 3 needs integer image_token_index, boi_token_index, eoi_token_index")
        return cls(ids[0], size // per_side, ImageWrap(ids[1], ids[2], size))

    @property
    def placeholder_id(self) -> int:
        """The token the chat template writes once per image."""
        return self.image_token_id if self.wrap is None else self.wrap.start_id

    def rows(self, grid_thw: tuple[int, int, int]) -> int:
        """Embedding rows (= placeholder tokens) of an image of ``grid_thw`` patches."""
        t, h, w = grid_thw
        return t * h * w // (self.merge_size * self.merge_size)
