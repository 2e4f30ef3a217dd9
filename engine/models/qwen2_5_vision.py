"""Qwen2.5-VL's vision tower: 3-D patch embedding, 2-D rotary, window attention with a few full-attention blocks,
and the patch merger that turns each 2 x 2 patch cell into one language-model embedding. Plain torch layers (the
tower runs once per image, then the encoder cache serves it); module names follow the checkpoint's ``visual.*``.
The patch embedding, rotary, attention and block are Qwen3-VL's tower's too (engine/models/qwen3_vision.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TowerConfig:
    """The settings Qwen2.5-VL's and Qwen3-VL's towers share (``vision_config``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    rope_theta: float

    @staticmethod
    def shared(v: dict) -> dict:
        """``vision_config``'s shared settings, as keyword arguments."""
        rope = v.get("rope_parameters") or {}
        return dict(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                    num_heads=v["num_heads"], in_channels=v.get("in_channels", 3), patch_size=v["patch_size"],
                    temporal_patch_size=v.get("temporal_patch_size", 2), merge_size=v.get("spatial_merge_size", 2),
                    out_hidden_size=v["out_hidden_size"], rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclass(frozen=True, slots=True)
class VisionConfig(TowerConfig):
    window_size: int
    full_attention_blocks: tuple[int, ...]

    @classmethod
    def from_hf(cls, v: dict) -> VisionConfig:
        if v.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json vision_config.hidden_act: only silu is supported, got {v['hidden_act']!r}")
        return cls(**TowerConfig.shared(v), window_size=v["window_size"],
                   full_attention_blocks=tuple(v.get("fullatt_block_indexes", ())))


class VisionRMSNorm(nn.Module):
    """transformers' order: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter), nn.Linear(hidden, inter)
        self.down_proj = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] by the neox rotation, in fp32 as transformers does."""
    h = x.float()
    x1, x2 = h.chunk(2, dim=-1)
    return (h * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention within each of ``segments`` (consecutive lengths), none across them."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in parts)).transpose(0, 1)
               for parts in zip(q.split(segments), k.split(segments), v.split(segments))]
        return self.proj(torch.cat(out).reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    """A pre-norm block; ``norm`` builds its two norms (Qwen2.5-VL's RMSNorm, Qwen3-VL's LayerNorm)."""

    def __init__(self, hidden: int, num_heads: int, norm: Callable[[int], nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(hidden), norm(hidden)
        self.attn = VisionAttention(hidden, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.width = c.hidden_size * c.merge_size ** 2
        self.ln_q = VisionRMSNorm(c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, c.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """Each patch (channels x temporal_patch x patch x patch pixels) to a ``hidden``-wide row: one 3-D conv."""

    def __init__(self, in_channels: int, temporal_patch: int, patch: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.shape = (-1, in_channels, temporal_patch, patch, patch)
        self.proj = nn.Conv3d(in_channels, hidden, self.shape[2:], stride=self.shape[2:], bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        return proj(pixel_values.to(proj.weight.dtype).view(self.shape)).view(-1, proj.out_channels)


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c.in_channels, c.temporal_patch_size, c.patch_size, c.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(c.hidden_size, c.num_heads, VisionRMSNorm,
                                                VisionMLP(c.hidden_size, c.intermediate_size)) for _ in range(c.depth))
        self.merger = PatchMerger(c)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The images' embeddings [sum of their merged cells, out_hidden_size], image after image."""
        c, unit = self.config, self.config.merge_size ** 2
        x = self.patch_embed(pixel_values)
        order, windows = _window_order(grids, c)
        x = x.view(-1, unit, c.hidden_size)[order].view(-1, c.hidden_size)
        cos, sin = vision_rotary(grids, c.merge_size, c.hidden_size // c.num_heads, c.rope_theta, x.device)
        cos, sin = (t.view(-1, unit, t.shape[-1])[order].view(-1, 1, t.shape[-1]) for t in (cos, sin))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in c.full_attention_blocks else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]


def vision_rotary(grids: list[tuple[int, int, int]], merge: int, head_dim: int, theta: float, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's fp32 cos and sin [patches, head_dim] (the 2-D rotary of Qwen2.5-VL's and Qwen3-VL's towers):
    its row's angles, then its column's, twice."""
    half = head_dim // 2  # rows and columns each turn a quarter of the head's angles
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    freqs = (patch_rows_cols(grids, merge)[..., None].float() * inv_freq).flatten(1)
    freqs = torch.cat((freqs, freqs), dim=-1).to(device)
    return freqs.cos(), freqs.sin()


def patch_rows_cols(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of each patch in the processor's order: merge x merge cells, row-major."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        cell = torch.stack((rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()), dim=-1)
        out.append(cell.repeat(t, 1))
    return torch.cat(out)


def _window_order(grids: list[tuple[int, int, int]], c: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """The merged cells reordered window by window (each window ``window_size`` pixels square, row-major within
    it), and each window's length in patches."""
    side = c.window_size // c.merge_size // c.patch_size  # a window's side in merged cells
    unit, order, lengths, base = c.merge_size ** 2, [], [], 0
    for t, h, w in grids:
        h, w = h // c.merge_size, w // c.merge_size
        cells = torch.arange(t * h * w).view(t, h, w)
        for frame in cells:
            for top in range(0, h, side):
                for left in range(0, w, side):
                    window = frame[top:top + side, left:left + side].flatten()
                    order.append(window + base)
                    lengths.append(len(window) * unit)
        base += t * h * w
    return torch.cat(order), lengths
