"""Qwen2.5-VL: Qwen2's decoder (its settings under ``text_config``) behind a vision tower whose embeddings replace
the image placeholder tokens' (engine/multimodal), with multimodal RoPE. Checkpoint names as transformers saves
them: ``model.*`` the decoder, ``visual.*`` the tower."""
from __future__ import annotations

import torch

from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.llama import Qwen2ForCausalLM
from engine.models.qwen2_5_vision import Qwen2_5_VisionTransformer, VisionConfig
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.mrope import mrope_sections, mrope_step
from engine.multimodal.step import ImageRows


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture}: tensor parallelism is not supported for vision-language models "
                             "(tensor_parallel_size must be 1)")
        super().__init__(cfg, device, dtype, tp)
        self.visual = Qwen2_5_VisionTransformer(VisionConfig.from_hf(cfg.hf["vision_config"]))
        self.sections = mrope_sections(cfg.hf, self.model.rotary.rotary_dim, device)

    @torch.inference_mode()
    def encode_images(self, images: list[ImagePatches]) -> list[torch.Tensor]:
        """Each image's embeddings [placeholder tokens, hidden], the images run through the tower together."""
        device = self.sections.device
        pixels = torch.cat([image.pixel_values for image in images]).to(device)
        grids = [image.grid_thw for image in images]
        unit = self.visual.config.merge_size ** 2
        return list(self.visual(pixels, grids).split([t * h * w // unit for t, h, w in grids]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                images: ImageRows | None = None) -> torch.Tensor:
        """``images``: a step with image rows, their embeddings and the step's 3-D positions; without them every
        row is text, whose M-RoPE is plain RoPE at ``positions``."""
        if images is None:
            return self.model(input_ids, positions, meta)
        m = self.model
        h = m.embed_tokens(input_ids)
        h = h.index_copy(0, images.rows, images.embeds.to(h.dtype))
        rope, residual = mrope_step(m.rotary, self.sections, images.positions), None
        for layer in m.layers:
            h, residual = layer(rope, h, residual, meta)
        return m.norm(h, residual)
