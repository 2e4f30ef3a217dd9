"""Qwen3-VL's vision tower: Qwen2.5-VL's patch embedding, 2-D rotary and attention (engine/models/qwen2_5_vision.py)
with LayerNorm blocks, every block attending over its whole frame, learned position embeddings resampled
bilinearly to each image's grid, and DeepStack: the outputs of ``deepstack_visual_indexes`` blocks, each merged
by its own merger, which the language model adds to the image tokens' hidden states after its first layers."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.qwen2_5_vision import PatchEmbed, TowerConfig, VisionBlock, patch_rows_cols, vision_rotary

_ACTIVATIONS = {"gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu}
_LayerNorm = partial(nn.LayerNorm, eps=1e-6)


@dataclass(frozen=True, slots=True)
class Qwen3VisionConfig(TowerConfig):
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    hidden_act: str

    @classmethod
    def from_hf(cls, v: dict) -> Qwen3VisionConfig:
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise ValueError(f"config.json vision_config.hidden_act: one of {sorted(_ACTIVATIONS)}, got {act!r}")
        return cls(**TowerConfig.shared(v), num_position_embeddings=v["num_position_embeddings"],
                   deepstack_indexes=tuple(v.get("deepstack_visual_indexes", ())), hidden_act=act)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, c: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Each merge x merge cell of patches to one language-model row; the main merger normalises each patch before
    the cell is flattened, a DeepStack merger (``postshuffle``) the flattened cell."""

    def __init__(self, c: Qwen3VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width, self.postshuffle = c.hidden_size * c.merge_size ** 2, postshuffle
        self.norm = _LayerNorm(self.width if postshuffle else c.hidden_size)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, c: Qwen3VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.side = int(c.num_position_embeddings ** 0.5)  # the learned position grid is side x side
        self.patch_embed = PatchEmbed(c.in_channels, c.temporal_patch_size, c.patch_size, c.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c.hidden_size, c.num_heads, _LayerNorm, Qwen3VisionMLP(c))
                                    for _ in range(c.depth))
        self.merger = Qwen3PatchMerger(c, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(c, postshuffle=True) for _ in c.deepstack_indexes)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The images' rows [sum of their merged cells, out_hidden_size x (1 + DeepStack levels)], image after
        image: each row's main embedding, then its DeepStack ones in layer order (so the encoder cache and a
        step's splices carry them as one tensor)."""
        c = self.config
        x = self.patch_embed(pixel_values)
        x = x + self._position_embeddings(grids).to(x.dtype)
        cos, sin = (t[:, None] for t in vision_rotary(grids, c.merge_size, c.hidden_size // c.num_heads,
                                                          c.rope_theta, x.device))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            if i in c.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[c.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each patch's position embedding [patches, hidden]: the learned grid resampled bilinearly (corners
        aligned) at the patch's row and column, its four taps weighted as transformers weighs them."""
        rows_cols = patch_rows_cols(grids, self.config.merge_size)
        sizes = torch.tensor([(h, w) for t, h, w in grids for _ in range(t * h * w)])
        (row_taps, row_weights), (col_taps, col_weights) = (
            _taps(rows_cols[:, axis], sizes[:, axis], self.side) for axis in (0, 1))
        taps = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).flatten(1)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        device = self.pos_embed.weight.device
        return (self.pos_embed(taps.to(device)) * weights.to(device)[:, :, None]).sum(1)


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two grid entries either side of each target ``index`` on an axis of ``size`` points spread over the
    ``side`` learned ones (the ends on the ends), and their linear weights, in fp32."""
    src = index.float() * (side - 1) / (size - 1).clamp(min=1)
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
