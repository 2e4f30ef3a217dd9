"""Qwen2.5-VL: Qwen2's decoder behind its window-attention vision tower (engine/models/vision_language.py).
Checkpoint names as transformers saves them: ``model.*`` the decoder, ``visual.*`` the tower."""
from __future__ import annotations

from torch import nn

from engine.models.llama import Qwen2ForCausalLM
from engine.models.qwen2_5_vision import Qwen2_5_VisionTransformer, VisionConfig
from engine.models.vision_language import ImageTextModel


class Qwen2_5_VLForConditionalGeneration(ImageTextModel, Qwen2ForCausalLM):
    def build_tower(self, vision: dict) -> nn.Module:
        return Qwen2_5_VisionTransformer(VisionConfig.from_hf(vision))
