"""What the vision-language families share: a decoder (its settings under ``text_config``) behind a vision tower
whose embeddings replace the image placeholder tokens' (engine/multimodal), multimodal RoPE, and DeepStack rows
(Qwen3-VL) added to the image tokens' hidden states after the first decoder layers."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.mrope import mrope_sections, mrope_step
from engine.multimodal.step import ImageRows


class ImageTextModel:
    """Mixed in before a decoder family's class; ``build_tower`` gives the tower (``self.visual``), which maps
    (pixels, grids) to a row per merged cell: the main embedding, then any DeepStack ones."""

    interleaved_mrope = False  # Qwen3-VL interleaves the M-RoPE sections, Qwen2.5-VL runs them

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture}: tensor parallelism is not supported for vision-language models "
                             "(tensor_parallel_size must be 1)")
        super().__init__(cfg, device, dtype, tp)
        self.visual = self.build_tower(cfg.hf["vision_config"])
        self.hidden_size = cfg.hidden_size
        self.sections = mrope_sections(cfg.hf, self.model.rotary.rotary_dim, device, self.interleaved_mrope)

    def build_tower(self, vision: dict) -> nn.Module:
        raise NotImplementedError

    @torch.inference_mode()
    def encode_images(self, images: list[ImagePatches]) -> list[torch.Tensor]:
        """Each image's rows [placeholder tokens, hidden x (1 + DeepStack levels)], the images run through the
        tower together."""
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
        main, *deepstack = images.embeds.to(h.dtype).split(self.hidden_size, dim=-1)
        h = h.index_copy(0, images.rows, main)
        rope, residual = mrope_step(m.rotary, self.sections, images.positions), None
        for i, layer in enumerate(m.layers):
            h, residual = layer(rope, h, residual, meta)
            if i < len(deepstack):  # the layer's output summed as transformers sums it, then the rows added
                h, residual = (h + residual).index_add(0, images.rows, deepstack[i]), None
        return m.norm(h, residual)
