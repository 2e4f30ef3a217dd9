"""Qwen3-VL (dense): Qwen3's decoder (q/k RMSNorm) behind its vision tower with DeepStack (engine/models/
qwen3_vision.py), M-RoPE sections interleaved. Checkpoint names as transformers saves them:
``model.language_model.*`` the decoder, ``model.visual.*`` the tower."""
from __future__ import annotations

from torch import nn

from engine.models.llama import Qwen3ForCausalLM
from engine.models.qwen3_vision import Qwen3VisionConfig, Qwen3VisionTransformer
from engine.models.vision_language import ImageTextModel


class Qwen3VLForConditionalGeneration(ImageTextModel, Qwen3ForCausalLM):
    interleaved_mrope = True
    checkpoint_renames = {"model.language_model.": "model.", "model.visual.": "visual."}

    def build_tower(self, vision: dict) -> nn.Module:
        return Qwen3VisionTransformer(Qwen3VisionConfig.from_hf(vision))
