"""Gemma 3 with images: Gemma 3's text decoder (its settings under ``text_config``) behind a SigLIP tower and the
multimodal projector, whose embeddings replace the image tokens' (engine/multimodal). The text embeddings are
scaled by sqrt(hidden_size), the image ones are not; an image's tokens attend to each other both ways (the step's
``AttentionMetadata.bidirectional`` rows). Checkpoint names as transformers and the hub save them:
``language_model.model.*`` the decoder, ``vision_tower[.vision_model].*``, ``multi_modal_projector.*``."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata
from engine.layers.norm import GemmaRMSNorm
from engine.models.config import ModelConfig
from engine.models.gemma import Gemma3ForCausalLM
from engine.models.siglip import SiglipConfig, SiglipVisionTower
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.step import ImageRows


class Gemma3Projector(nn.Module):
    """The tower's patch grid average-pooled to ``mm_tokens_per_image`` cells, Gemma's RMSNorm, then a matmul into
    the text model's width."""

    def __init__(self, c: SiglipConfig, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        per_side = round(tokens_per_image ** 0.5)
        if per_side * per_side != tokens_per_image or c.side % per_side:
            raise ValueError(f"config.json: mm_tokens_per_image {tokens_per_image} must be a square whose side "
                             f"divides the tower's {c.side} patches per side")
        self.pool = nn.AvgPool2d(c.side // per_side)
        self.mm_soft_emb_norm = GemmaRMSNorm(c.hidden_size, c.eps)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(c.hidden_size, text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [images, patches, hidden] -> [images, tokens_per_image, text hidden]."""
        b, n, d = x.shape
        side = round(n ** 0.5)
        pooled = self.pool(x.transpose(1, 2).reshape(b, d, side, side)).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    checkpoint_renames = {"model.language_model.": "model.", "language_model.model.": "model.",
                          "model.vision_tower.": "vision_tower.", "vision_tower.vision_model.": "vision_tower.",
                          "model.multi_modal_projector.": "multi_modal_projector."}

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture}: tensor parallelism is not supported for vision-language models "
                             "(tensor_parallel_size must be 1)")
        super().__init__(cfg, device, dtype, tp)
        vision = SiglipConfig.from_hf(cfg.hf["vision_config"])
        self.vision_tower = SiglipVisionTower(vision)
        self.multi_modal_projector = Gemma3Projector(vision, cfg.hidden_size, cfg.hf.get("mm_tokens_per_image", 256))

    @staticmethod
    def unused_checkpoint_weight(name: str) -> bool:
        """SigLIP's pooling head: Gemma 3 reads the tower's patches, not its pooled output."""
        return ".head." in name and "vision_tower" in name

    @torch.inference_mode()
    def encode_images(self, images: list[ImagePatches]) -> list[torch.Tensor]:
        """Each image's embeddings [mm_tokens_per_image, hidden], the images through the tower together. An image's
        patches are its pixels, channels last (engine/multimodal/processor.py)."""
        conv = self.vision_tower.embeddings.patch_embedding
        pixels = torch.stack([image.pixel_values.view(*image.grid_thw[1:], -1).permute(2, 0, 1) for image in images])
        return list(self.multi_modal_projector(self.vision_tower(pixels.to(conv.weight.device))))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                images: ImageRows | None = None) -> torch.Tensor:
        """``images``: the step's image rows, their embeddings (unscaled) and their spans, attended both ways."""
        if images is None:
            return self.model(input_ids, positions, meta)
        m = self.model
        h = m.embed_tokens(input_ids) * m.embed_scale
        h = h.index_copy(0, images.rows, images.embeds.to(h.dtype))
        return m.decode(h, positions, replace(meta, bidirectional=images.spans))
